"""Weight sync: a mode (what is sent) x a transport (how it moves); the receiver stages, checks, swaps.

A placement driver calls one thing: ``session.SyncSession`` (start-up handle, ``connect``, ``due`` --
the one publish rule --, ``publish`` to N receivers, snapshot for catch-up, checksum), with receivers
in this process (``session.LocalReceiver``) or Ray actors. Below it, the parts:

Publisher side (trainer process), one object per mode (``factory.make_publisher(mode, dtype)``)::

    publisher.publish(model, version, full=False) -> WeightUpdate   # full=True after a rejection
    publisher.expected(model) -> {name: tensor}                     # for the equality check

``full.FullPublisher`` (every parameter), ``delta.DeltaPublisher`` (changed elements in the rollout
dtype + int32 indices or a bitmask; first publish is full), ``lora.LoraPublisher`` (adapter tensors;
``full=True`` adds the base), ``inprocess.SharedPublisher`` (colocated, shared module, no tensors).

Transport, one object per process (``factory.make_transport(name, bucket_mb, **dist_kwargs)``)::

    transport.send(update) -> int      # bytes it moved: values + indices + framing (-> the ledger)
    transport.recv() -> WeightUpdate   # ray: recv(ref) in another process, ref = sender's transport.ref

``transport_inprocess.InProcessTransport`` (0 bytes), ``transport_dist.DistTransport(bucket_bytes,
src=0, group=None, device="cpu")`` (caller creates the process group: gloo/NCCL),
``transport_ray.RayTransport()`` (object store; bytes = serialized size).

Receiver side (rollout process): ``engine.load_weights(update)`` stages the update beside the
live weights (``apply.Receiver``: payload checksum, shapes, a delta's base version), then swaps and
refreshes the fast path. A bad update raises ``wire.SyncRejected`` with nothing changed: publish
again with ``full=True`` (the session sends the last version whole; ``session.push_pull`` does it by
hand in one process, for tests and benches).

Equality check: ``check.compare_weights(publisher.expected(model), rollout_model, version)`` at
start-up and every ``sync.check_every`` syncs; raises ``check.WeightsDiffer`` naming the first
differing tensor and its max difference. Across processes compare ``check.weights_checksum(...)``
of both sides first and ship tensors only on a mismatch.

Start-up: ``factory.resolve(cfg, device) -> SyncPlan(mode, transport, dtype)`` resolves ``auto``
and rejects combinations that cannot work with a one-line ``ConfigError``.
"""
