#!/usr/bin/env python
"""rl_sync weight pushes on one GPU: trainer (this process) and one generator process, colocated.

Usage::

    python bench/bench_rl_gpu.py [--params-b 30] [--modes-params-b 7] [--reps 3] [--json PATH]
    python bench/bench_rl_gpu.py --device cpu --params-b 0.02 --modes-params-b 0.01   # the harness on CPU

A benchmark, not a test: it prints a table and writes JSON. Without CUDA (and without
``--device cpu``) it prints ``no CUDA: skipped`` and exits 0.

Rows:

* ``headline``: a push of a ``--params-b`` billion-parameter bf16 model (a synthetic state dict
  with Llama-like shapes: embeddings, per layer q/k/v/o, gate/up/down, two norms; untied head)
  from the trainer's live weights into a ``mode="direct"`` generator (``live="auto"``: no send
  slot, no pack; one device-to-device copy per byte, over ``cuda_ipc``). Next to it, in the same
  run: the limit, a device-to-device ``copy_`` of the same bytes (rate measured on 4 GiB buffers,
  scaled), and what colocated frameworks do today: per-tensor CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor`` in the trainer, rebuilt in the generator,
  each copied into its weight, then synchronized). Target: <= 50 ms for 30B.
* ``modes``: a ``--modes-params-b`` model pushed in each of ``staged``, ``swap``, ``direct``
  (float32 trainer -> bfloat16 generator, packed and cast on the trainer's GPU), and ``direct``
  served live (bf16 -> bf16), with the generator's GPU memory for the model (device memory in
  use after its subscriber was built, less before: ``torch.cuda.mem_get_info``).

Each push is timed by its :class:`rl_sync.PushReport` (``seconds``, from the call to the last
commit), after one warm-up push (planning, registrations, mappings); the median of ``--reps``.
The generator's bytes are checked once per case against the trainer's (a checksum of every
tensor). Every wait is bounded.

Memory: the headline needs two bf16 copies of its model (trainer and generator) and a few GiB;
when that is more than the GPU's free memory (``torch.cuda.mem_get_info``: 30B needs ~125 GiB,
an H200's, not an 80 GB H100's) it is scaled down to the largest size that fits (13B, 6.7B, ...)
or skipped, and the reason is printed. Each case gives its memory back before the next. A row
that fails is recorded as ``{"case": ..., "error": ...}`` and the later rows still run; the exit
status is 1 when any row failed or its bytes differ.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30
WAIT_S = 600.0
HEADROOM = 4 * GiB  # the headline's need beyond its two model copies: CUDA contexts, adopt arena, slack


def llama_spec(params_b: float) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Llama-like model of about ``params_b`` billion parameters."""
    vocab = 32000
    if params_b >= 20:
        hidden, layers, ffn = 6656, 60, 17920  # ~32.5B (Llama-30B's shapes)
    elif params_b >= 10:
        hidden, layers, ffn = 5120, 40, 13824  # ~13B (Llama-13B's): the headline that fits an 80 GB GPU
    elif params_b >= 5:
        hidden, layers, ffn = 4096, 32, 11008  # ~6.7B (Llama-7B's)
    else:  # small: keep the shapes' proportions, scaled to the size asked for
        hidden = max(64, int((params_b * 1e9 / 12 / 24) ** 0.5) // 64 * 64)
        layers, ffn, vocab = 24, hidden * 8 // 3 // 64 * 64, 4096
    spec: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            spec[f"{p}self_attn.{n}.weight"] = (hidden, hidden)
        spec[f"{p}mlp.gate_proj.weight"] = (ffn, hidden)
        spec[f"{p}mlp.up_proj.weight"] = (ffn, hidden)
        spec[f"{p}mlp.down_proj.weight"] = (hidden, ffn)
        spec[f"{p}input_layernorm.weight"] = (hidden,)
        spec[f"{p}post_attention_layernorm.weight"] = (hidden,)
    spec["model.norm.weight"] = (hidden,)
    spec["lm_head.weight"] = (vocab, hidden)
    return spec


def _numel(spec: dict[str, tuple[int, ...]]) -> int:
    n = 0
    for shape in spec.values():
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def _generator(conn: Any, store: str, name: str, spec: dict[str, tuple[int, ...]], mode: str, device: str) -> None:
    """Child: a WeightSubscriber on ``device``; answers commands from the pipe until told to stop."""
    import torch

    import rl_sync
    import transport

    async def run() -> None:
        async with transport.Endpoint(name, store=store, timeout=120) as ep:
            free0 = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else 0
            model = {n: torch.empty(sh, dtype=torch.bfloat16, device=device) for n, sh in spec.items()}
            sub = rl_sync.WeightSubscriber(ep, model, mode=mode)
            used = (free0 - torch.cuda.mem_get_info()[0]) if device.startswith("cuda") else 0
            conn.send(("ready", used))
            end = time.monotonic() + WAIT_S
            while time.monotonic() < end:
                if not conn.poll():
                    await asyncio.sleep(0.01)
                    continue
                cmd, *args = conn.recv()
                if cmd == "stop":
                    return
                if cmd == "sum":  # a checksum of every tensor, inside hold()
                    async with sub.hold() as v:
                        conn.send((v, _checksum(torch, model)))
                elif cmd == "ipc":  # today's way: per-tensor CUDA IPC handles, rebuilt and copied
                    handles = args[0]
                    t0 = time.perf_counter()
                    async with sub.hold():
                        for n, (fn, fargs) in handles.items():
                            model[n].copy_(fn(*fargs))
                        torch.cuda.synchronize()
                    conn.send(time.perf_counter() - t0)

    try:
        asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _checksum(torch: Any, tensors: dict[str, Any], as_dtype: Any = None) -> float:
    """The sum of every element, one tensor at a time (cast to ``as_dtype`` first, if given): at most
    one tensor's temporary copy exists at a time, never a second copy of the whole model."""
    total = 0.0
    for t in tensors.values():
        total += float((t if as_dtype is None else t.to(as_dtype)).float().sum().item())
    return total


class _Gen:
    def __init__(self, store: str, spec: dict[str, tuple[int, ...]], mode: str, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = f"bench-gen-{uuid.uuid4().hex[:6]}"
        self.proc = ctx.Process(target=_generator, args=(child, store, self.name, spec, mode, device), daemon=True)
        self.proc.start()
        kind, self.used = self.recv()
        if kind != "ready":
            raise RuntimeError(f"generator failed: {self.used}")

    def recv(self, timeout: float = WAIT_S) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the generator did not answer")
        got = self.conn.recv()
        if isinstance(got, tuple) and got and got[0] == "error":
            raise RuntimeError(f"generator: {got[1]}")
        return got

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.recv()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


async def _push_case(torch: Any, store: str, spec: dict[str, tuple[int, ...]], mode: str, device: str,
                     trainer_dtype: Any, reps: int, ipc_baseline: bool = False) -> dict[str, Any]:
    import rl_sync
    import transport

    gen = _Gen(store, spec, mode, device)
    try:
        async with transport.Endpoint(f"bench-trainer-{uuid.uuid4().hex[:6]}", store=store, timeout=120) as ep:
            g = torch.Generator(device=device).manual_seed(1)
            weights = {n: torch.empty(sh, dtype=trainer_dtype, device=device).normal_(generator=g)
                       for n, sh in spec.items()}
            cast = None if trainer_dtype == torch.bfloat16 else torch.bfloat16
            pub = rl_sync.WeightPublisher(ep, [gen.name], dtype=cast, bucket_bytes=1 << 30)
            try:
                secs, report = [], None
                for version in range(1, reps + 2):
                    report = await pub.push(weights, version, timeout=WAIT_S)
                    if not report.ok:
                        raise RuntimeError(report.summary())
                    if version > 1:
                        secs.append(report.seconds)
                assert report is not None
                v, got = await asyncio.to_thread(gen.call, "sum")
                want = _checksum(torch, weights, as_dtype=torch.bfloat16)  # one tensor at a time
                r = report.results[gen.name]
                row: dict[str, Any] = {
                    "mode": mode, "live": report.packed_bytes == 0, "bytes": r.bytes,
                    "push_ms_median": statistics.median(secs) * 1e3, "push_ms": [s * 1e3 for s in secs],
                    "plane": r.plane, "plane_reason": r.plane_reason, "generator_gpu_bytes": gen.used,
                    "checked": v == reps + 1 and abs(got - want) <= 1e-3 * max(1.0, abs(want)),
                }
                if ipc_baseline:
                    from torch.multiprocessing.reductions import reduce_tensor

                    times = []
                    for _ in range(reps):
                        # fresh handles per repetition: torch's IPC ref counters expect each handle to be
                        # rebuilt once; rebuilding one handle again would leave the trainer's blocks in
                        # its IPC limbo after they are freed
                        handles = {n: reduce_tensor(t) for n, t in weights.items()}
                        times.append(await asyncio.to_thread(gen.call, "ipc", handles))
                        del handles
                    row["per_tensor_ipc_ms_median"] = statistics.median(times) * 1e3
                return row
            finally:
                pub.close()  # unregisters its slots and the live aliases of the trainer's weights
    finally:
        gen.stop()


def _run_case(torch: Any, device: str, case: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """One row: ``_push_case`` in its own event loop; an exception becomes ``{"case", "error"}`` so the
    later rows still run. On CUDA the case's memory is given back afterwards (its weights, the IPC
    limbo of blocks the generator had opened, the caching allocator's cache)."""
    try:
        row = asyncio.run(_push_case(torch, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the exit status says a row failed
        row = {"case": case, "error": repr(exc), "checked": False}
    gc.collect()
    if device.startswith("cuda"):
        try:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - e.g. a sticky CUDA error: recorded, the next rows still try
            row.setdefault("cleanup_error", repr(exc))
    return row


def _headline_spec(torch: Any, params_b: float, device: str) -> tuple[dict[str, tuple[int, ...]] | None, str]:
    """The headline's model: ``params_b``'s, or the largest smaller one whose two copies (trainer and
    generator) and a few GiB for contexts and arenas fit in the GPU's free memory; ``None`` if none
    does. Also says what was chosen and why."""
    spec = llama_spec(params_b)
    if not device.startswith("cuda"):
        return spec, ""
    free, total = torch.cuda.mem_get_info()

    def need(sp: dict[str, tuple[int, ...]]) -> int:
        return 2 * (2 * _numel(sp)) + HEADROOM

    if need(spec) <= free:
        return spec, ""
    asked = (f"headline {_numel(spec) / 1e9:.1f}B needs ~{need(spec) / GiB:.0f} GiB (trainer + generator bf16 "
             f"copies + {HEADROOM // GiB} GiB), {free / GiB:.0f} of {total / GiB:.0f} GiB free")
    for p in (30.0, 13.0, 7.0, 3.0, 1.0, 0.3):
        if p < params_b:
            sp = llama_spec(p)
            if need(sp) <= free:
                return sp, f"{asked}: scaled down to {_numel(sp) / 1e9:.1f}B (~{need(sp) / GiB:.0f} GiB)"
    return None, f"{asked}: skipped (no smaller size fits)"


def _d2d_rate(torch: Any, device: str) -> float:
    """Bytes per second of a device-to-device copy_ of 4 GiB (CPU: of 256 MiB)."""
    n = 4 * GiB if device.startswith("cuda") else GiB // 4
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return n / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-b", type=float, default=30.0, help="headline model size, billions of parameters")
    ap.add_argument("--modes-params-b", type=float, default=7.0, help="model size for the per-mode rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default=None, help="cuda:0 (default when CUDA is there) or cpu (the harness only)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-headline", action="store_true")
    ap.add_argument("--skip-modes", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from torch.distributed import TCPStore

    device = args.device or ("cuda:0" if torch.cuda.is_available() else None)
    if device is None:
        print(f"no CUDA: skipped (torch {torch.__version__})")
        return 0
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{store.port}"
    rate = _d2d_rate(torch, device)
    doc: dict[str, Any] = {"device": device, "d2d_gbps": rate / 1e9, "rows": []}
    if device.startswith("cuda"):
        doc["gpu"] = torch.cuda.get_device_name(0)
    print(f"device {device}: d2d copy_ {rate / 1e9:.0f} GB/s")
    print(f"{'case':34} {'GB':>6} {'push ms':>9} {'limit ms':>9} {'ratio':>6} {'ipc ms':>8} {'gen GPU GB':>10}  plane")
    if not args.skip_headline:
        # (the headline's tensors, ~2 x 60 GB for 30B, are given back after it: _run_case)
        head_spec, why = _headline_spec(torch, args.params_b, device)
        if why:
            print(why)
            doc["headline_note"] = why
        if head_spec is None:
            print(f"SUMMARY rl_sync colocated push headline skipped: {why}")
        else:
            nbytes = 2 * _numel(head_spec)
            case = f"headline {_numel(head_spec) / 1e9:.1f}B direct live"
            row = _run_case(torch, device, case, url, head_spec, "direct", device, torch.bfloat16, args.reps,
                            ipc_baseline=device.startswith("cuda"))
            _finish_row(row, case, nbytes / rate * 1e3)
            doc["rows"].append(row)
            _print(row)
            _save(args.json, doc)  # after each row: a run killed at its time limit keeps the rows it measured
    if not args.skip_modes:
        spec = llama_spec(args.modes_params_b)
        nbytes = 2 * _numel(spec)
        for mode, dtype in (("staged", torch.float32), ("swap", torch.float32), ("direct", torch.float32),
                            ("direct", torch.bfloat16)):
            case = f"{_numel(spec) / 1e9:.1f}B {mode}{' live' if dtype == torch.bfloat16 else ' (f32->bf16)'}"
            row = _run_case(torch, device, case, url, spec, mode, device, dtype, args.reps)
            if "error" not in row:  # named after what the push did (live or packed)
                case = f"{_numel(spec) / 1e9:.1f}B {mode}{' live' if row['live'] else ' (f32->bf16)'}"
            _finish_row(row, case, nbytes / rate * 1e3)
            doc["rows"].append(row)
            _print(row)
            _save(args.json, doc)
    head = next((r for r in doc["rows"] if r["case"].startswith("headline")), None)
    if head is not None and "error" in head:
        print(f"SUMMARY rl_sync colocated push {head['case']}: FAILED: {head['error']}")
    elif head is not None:
        ipc = head.get("per_tensor_ipc_ms_median")
        print(f"SUMMARY rl_sync colocated push {head['case']}: {head['push_ms_median']:.1f} ms (target <= 50 ms for 30B), "
              f"limit {head['limit_ms']:.1f} ms ({head['limit_ratio']:.2f}x)"
              + (f", per-tensor IPC handles {ipc:.1f} ms" if ipc else "") + f", checked={head['checked']}")
    failed = [r["case"] for r in doc["rows"] if not r.get("checked")]
    if failed:
        print(f"FAILED rows ({len(failed)}): {', '.join(failed)}")
    _save(args.json, doc)
    return 1 if failed else 0


def _finish_row(row: dict[str, Any], case: str, limit_ms: float) -> None:
    """Name the row; a measured one also gets the d2d limit and its ratio."""
    row["case"] = case
    if "error" not in row:
        row["limit_ms"] = limit_ms
        row["limit_ratio"] = limit_ms / row["push_ms_median"]


def _save(path: Path | None, doc: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2))


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['case']:34} ERROR {row['error']}")
        return
    ipc = row.get("per_tensor_ipc_ms_median")
    print(f"{row['case']:34} {row['bytes'] / 1e9:6.2f} {row['push_ms_median']:9.1f} {row['limit_ms']:9.1f} "
          f"{row['limit_ratio']:6.2f} {ipc if ipc is not None else float('nan'):8.1f} "
          f"{row['generator_gpu_bytes'] / 1e9:10.2f}  {row['plane']}{'' if row['checked'] else '  BYTES DIFFER'}")


if __name__ == "__main__":
    sys.exit(main())
