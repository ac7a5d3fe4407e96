"""Floor 1: the launcher's reader of the router's request record (``router.record`` writes it).

``tail`` reads the end of the record without loading a long run, ``view`` turns records into the
dashboard's rollouts figures (no rendering), ``plots`` writes a finished job's step timeline. The
dashboard, the bench and the driver's teardown read through here, so none of them imports another."""
