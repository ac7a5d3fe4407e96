"""Streamed weights on CPU engines: rl-launch's weight-transfer backend ``rl_launch_gloo``, its wire and
its sender.

Why: none of the weight-transfer backends vLLM 0.32 ships runs on a CPU engine (the router's
``router.fleet.transfer_backends``): ``nccl``, ``sparse_nccl`` and ``nccl_m2n`` need libnccl and CUDA
streams, ``ipc`` CUDA IPC handles, ``sharded_rdt`` Ray actors with NIXL and CUDA events, ``modelexpress``
a package of its own; and the engines' common ``update_weights`` ends with
``torch.accelerator.synchronize()``, which raises on a machine without an accelerator. So a trainer could
not stream into a CPU fleet at all, and the streamed path (``/init_weight_transfer_engine`` ...
``/finish_weight_update``, the router's ``/fleet/weight_transfer/init`` and ``/fleet/refit/update``) was
never run on real engines here. ``rl_launch_gloo`` is the same protocol as vLLM's ``nccl`` backend over
``torch.distributed``'s gloo (CPU tensors over TCP): the same init fields (``master_address``,
``master_port``, ``rank_offset``, ``world_size``; the trainer is rank 0 and hosts the rendezvous store),
the same per-round update info (``names``, ``dtype_names``, ``shapes``) and the same layerwise reload
around it, so the router's rank plan and fan-out work unchanged. It is selected per engine with
``--weight-transfer-config '{"backend": "rl_launch_gloo"}'`` and registered with vLLM's
``WeightTransferEngineFactory`` when the launcher's worker extension is imported (``register``, called by
``rl_launch_weights``). One round is one broadcast of one packed buffer (the round's tensors' bytes, in
``names`` order): gloo's per-call cost is paid once per round, not once per tensor.

What it is not: a GPU path. On GPU engines ``nccl`` is the one to use (gloo would copy every tensor
through host memory); nothing here makes ``nccl``, ``ipc`` or the others run on a CPU.

Standard library at import (torch inside the functions): this module is imported by the engine's
interpreter (through ``rl_launch_weights``), by the launcher's (``launcher.engines.vllm.worker_ext``) and
by a trainer, which runs it as a script to send (``python rl_launch_gloo.py send ...``, see ``main``)
or imports ``GlooSender``. The engine class is in ``rl_launch_gloo_engine`` (it subclasses vLLM's), loaded
by vLLM's factory by name inside the engine only.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

BACKEND = "rl_launch_gloo"
"""The ``backend`` of ``--weight-transfer-config`` that selects this transport."""
ENGINE_MODULE, ENGINE_CLASS = "rl_launch_gloo_engine", "GlooWeightTransferEngine"
STORE_PREFIX = "rl_launch_gloo"
DEFAULT_TIMEOUT_S = 600.0
"""How long a member waits for the others (the rendezvous and each broadcast): the engines wait in
``init_weight_transfer_engine`` for the trainer to join, as the router's ``INIT_TIMEOUT_S`` allows."""
DEFAULT_ROUND_BYTES = 256 << 20
"""The largest round ``rounds`` builds: one round is one packed buffer on the trainer and on every engine."""
UPDATE_FIELDS = ("names", "dtype_names", "shapes")


def register() -> bool:
    """Register ``BACKEND`` with vLLM's ``WeightTransferEngineFactory`` (by module name, so the engine
    class is imported only when an engine is started with it); False where vLLM is not importable (the
    launcher's and a trainer's interpreter). Registering twice is a no-op."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:  # already registered (this module imported twice)
        pass
    return True


def _gloo(store: Any, address: str, rank: int, world_size: int, timeout_s: float, key: str) -> Any:
    """The gloo group over ``store``, its connections bound to ``address`` (never to an interface the
    host name happens to resolve to), without touching ``torch.distributed``'s default group (a vLLM
    worker has its own). Its rendezvous keys live under ``key`` (see ``GlooSender.open``). Blocks until
    every member joined or ``timeout_s`` passed."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    prefix = f"{STORE_PREFIX}/{key}" if key else STORE_PREFIX
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, opts)


def join_group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, key: str = ""
) -> Any:
    """An engine rank joins the trainer's group (rank 0 hosts the store on ``address:port``; ``key``: the
    trainer's ``group_key``): the ``(group, store)`` pair, kept together (the group needs its store)."""
    import torch.distributed as dist

    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    return _gloo(store, address, rank, world_size, timeout_s, key), store


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype_names: {name!r} is not a torch dtype")
    return dtype


def round_sizes(update_info: dict[str, Any]) -> list[int]:
    """Each tensor's byte count in the round's packed buffer, from its ``dtype_names`` and ``shapes``."""
    import torch

    sizes = []
    for dtype_name, shape in zip(update_info["dtype_names"], update_info["shapes"], strict=True):
        count = 1
        for dim in shape:
            count *= int(dim)
        sizes.append(count * torch.empty((), dtype=_dtype(dtype_name)).element_size())
    return sizes


def unpack(buffer: Any, update_info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each tensor of a received round: views into ``buffer`` (uint8)."""
    offset = 0
    sizes = round_sizes(update_info)
    for name, dtype_name, shape, size in zip(
        update_info["names"], update_info["dtype_names"], update_info["shapes"], sizes, strict=True
    ):
        chunk, dtype = buffer[offset : offset + size], _dtype(dtype_name)
        if offset % chunk.new_empty((), dtype=dtype).element_size():
            chunk = chunk.clone()  # a view must start on its element size (an fp32 after an odd bf16 count)
        yield name, chunk.view(dtype).reshape([int(d) for d in shape])
        offset += size


def pack(tensors: list[Any]) -> Any:
    """The round's packed buffer: each tensor's bytes (on the CPU, contiguous) in order."""
    import torch

    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def update_info_of(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The round's ``update_info`` (what ``/update_weights`` carries): names, dtype names, shapes."""
    return {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }


def layer_of(name: str) -> str:
    """The decoder layer a tensor belongs to: its name up to the first integer segment
    (``model.layers.3``), or ``""`` for the rest (embeddings, final norm, ``lm_head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def rounds(
    named: Iterable[tuple[str, Any]], max_bytes: int = DEFAULT_ROUND_BYTES
) -> list[list[tuple[str, Any]]]:
    """The tensors cut into rounds of whole decoder layers, at most ``max_bytes`` each where a layer
    fits (a larger layer is a round alone).

    Whole layers because the router wraps each round in its own ``start_weight_update`` /
    ``finish_weight_update`` (``RefitCoordinator.receive``), and vLLM's layerwise reload finalizes every
    module at ``finish``: a module that received only some of its checkpoint tensors (``q_proj`` in one
    round, ``k_proj`` and ``v_proj`` in the next: vLLM fuses them into ``qkv_proj``) is processed with the
    rest of its storage unwritten. Measured on 2 CPU engines with rounds cut by bytes alone: the two
    engines ended with different weights. A module that received nothing in a round keeps its weights."""
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in named:
        groups.setdefault(layer_of(name), []).append((name, tensor))
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for group in groups.values():
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].extend(group)
        size += nbytes
    return [r for r in out if r]


class GlooSender:
    """The trainer's side: rank 0 of the group, which hosts the rendezvous and broadcasts each round.

    Use: ``GlooSender.open(address, world_size)`` (the port is the OS's: ``.port``) before the engines
    are told to join (``POST /fleet/weight_transfer/init`` with ``master_port=.port``), then ``join()``
    while that call is in flight (both block until every member is in), then per round ``send(tensors)``
    while ``POST /fleet/refit/update`` with ``update_info_of(tensors)`` is in flight."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float, key: str) -> None:
        self.address, self.port, self.world_size, self.timeout_s = address, port, world_size, timeout_s
        self.group_key = key
        self.group: Any = None
        self._store: Any = None

    @property
    def init_info(self) -> dict[str, Any]:
        """What the engines' ``init_info`` must carry beside the rendezvous (``"init_info"`` of
        ``POST /fleet/weight_transfer/init``): the group key, when there is one."""
        return {"group_key": self.group_key} if self.group_key else {}

    @classmethod
    def open(
        cls, address: str, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, keyed: bool = True
    ) -> GlooSender:
        """Bind the rendezvous store on ``address`` (an OS-chosen port) so the engines can be sent it.

        ``keyed``: the group's rendezvous keys live under a random ``group_key`` that reaches the engines
        only in ``init_info`` (through the router's admin route and the engines' key-guarded route). The
        store has no authentication: anyone who reaches its port may read and write keys, and with the
        well-known prefix alone could register as an engine's rank and be sent the weights. Off for a
        trainer whose client sends no extra init fields (TRL's sends nccl's own).

        The socket is bound here and handed to the store: a ``TCPStore`` given only a port listens on
        every interface (``*:PORT``, seen with ``ss -ltn``), where anyone on any node could reach the
        rendezvous; bound to ``address`` it is ``127.0.0.1:PORT`` in the tests. The store owns the socket
        from then on (``detach``): closing it under the store's listening thread aborts the process."""
        import socket

        import torch.distributed as dist

        if world_size < 2:
            raise ValueError(
                f"world_size must count the trainer and at least one engine rank, got {world_size}"
            )
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=False,  # the libuv store does not take a listening socket
        )
        sender = cls(address, port, world_size, timeout_s, secrets.token_hex(16) if keyed else "")
        sender._store = store
        return sender

    def join(self) -> None:
        """Form the group with the engines (blocks until each engine's ``init_weight_transfer_engine``
        joined)."""
        self.group = _gloo(self._store, self.address, 0, self.world_size, self.timeout_s, self.group_key)

    def send(self, named: list[tuple[str, Any]]) -> int:
        """Broadcast one round (the engines receive it in ``update_weights``); its size in bytes."""
        if self.group is None:
            raise RuntimeError("join() the group before sending")
        buffer = pack([t for _, t in named])
        self.group.broadcast(buffer, 0).wait()
        return int(buffer.numel())

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        self._store = None


def _load(path: str) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return sorted(load_file(path).items())


def main(argv: list[str] | None = None) -> int:
    """``send --address A --world-size W --weights FILE.safetensors [--round-bytes N]``: the trainer's
    data plane as a process. Prints one JSON line ``{"port", "init_info", "rounds": [update_info, ...]}`` once
    the store listens (the caller sends the engines ``port`` with ``init_info``, and each round's
    ``update_info``), joins, sends
    every round, then prints ``{"bytes", "join_s", "rounds_s": [...]}`` and exits 0."""
    parser = argparse.ArgumentParser(prog="rl_launch_gloo")
    sub = parser.add_subparsers(dest="command", required=True)
    send = sub.add_parser("send")
    send.add_argument("--address", default="127.0.0.1")
    send.add_argument("--world-size", type=int, required=True)
    send.add_argument("--weights", required=True, help="a .safetensors file of the model's weights")
    send.add_argument("--round-bytes", type=int, default=DEFAULT_ROUND_BYTES)
    send.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    send.add_argument("--no-group-key", action="store_true", help="for a client that cannot send it")
    args = parser.parse_args(argv)
    cut = rounds(_load(args.weights), args.round_bytes)
    sender = GlooSender.open(args.address, args.world_size, args.timeout_s, keyed=not args.no_group_key)
    opened = {"port": sender.port, "init_info": sender.init_info, "rounds": [update_info_of(r) for r in cut]}
    print(json.dumps(opened), flush=True)
    t0 = time.monotonic()
    sender.join()
    joined, times, total = time.monotonic(), [], 0
    for r in cut:
        start = time.monotonic()
        total += sender.send(r)
        times.append(round(time.monotonic() - start, 4))
    sender.close()
    print(json.dumps({"bytes": total, "join_s": round(joined - t0, 4), "rounds_s": times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
