"""Continuation: a generation that outlives its engine.

When an engine dies, restarts, is drained or quarantined in the middle of a generation, the request
would lose everything it produced (the forwarder's retry starts it again from the prompt elsewhere).
For the requests this package can follow (``plan.plan_of``: completions and chat, one choice, no tool or
guided parsing), the router asks the engine for a stream with token ids, keeps what it produced
(``stitch.Answer``), and on a break sends the prompt's token ids plus the tokens produced to another
engine's ``/v1/completions`` (``plan.Plan.resume_body``), stitching the parts into one answer in the
shape the client asked (``loop.Continuation``). Which weights made which tokens goes with the answer
(``spans.Spans``). ``moves`` (the fleet's side) tells a request to move off an engine being drained.

This package is on the router's state floor: it imports ``router.state`` and ``router.policies``, never
``router.http`` (which calls it) nor ``router.fleet``.
"""
