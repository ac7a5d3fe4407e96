"""``router.kind: ray-serve`` (see ``gateway``): a Ray Serve application whose replicas own the engines."""
