"""The on-allocation driver: Ray, engines, router, Gym wiring, training, teardown."""
