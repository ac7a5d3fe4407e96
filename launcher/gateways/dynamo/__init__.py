"""``router.kind: dynamo``: a launcher-owned NVIDIA Dynamo fleet (``gateway``), the etcd/NATS runtime it
starts (``runtime``), its spec section and what it declares (``kind``)."""
