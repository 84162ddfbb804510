"""What every part of the GPU run shares: the deadline, the results file, timing, compiling in
parallel and the ceilings (copy and read bandwidth, bf16 matrix rate) measured on the machine of the
run."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def error_text(e: BaseException, limit: int = 600) -> str:
    """The exception's type and the end of its message (XLA errors put the cause last)."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= limit else text[:200] + " … " + text[-(limit - 200) :]


def prompt_attention(compiled) -> str:
    """The prompt attention a compiled program holds: "cudnn" (cuDNN's flash attention) or "xla"."""
    return "cudnn" if "cudnn" in compiled.as_text() else "xla"


def rel_error(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (NaN where x is not finite)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


class Deadline:
    """A point in time a run or a phase must not start new work after."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self) -> bool:
        return self.left() <= 0


class Results:
    """Rows per table, saved to the JSON file ``path`` after every row so a run cut short keeps what
    it measured."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path, self.meta, self.parts = path, meta, {}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, part: str, row: dict[str, Any]) -> None:
        self.parts.setdefault(part, []).append(row)
        self.save()

    def rows(self, part: str) -> list[dict[str, Any]]:
        return self.parts.get(part, [])

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "parts": self.parts}, indent=1, default=str))
        tmp.replace(self.path)


def median_seconds(run: Callable[[], Any], repeats: int, min_batch_s: float = 0.02) -> float:
    """Median seconds of one ``run()`` (which returns arrays): calls are issued back to back in
    batches of n (n grown until a batch takes ``min_batch_s``, so launch gaps overlap the device's
    work), after a warm-up; the median over ``repeats`` batches. Only the last output of a batch is
    kept and waited for: one device runs its work in order, and earlier outputs are freed as they
    are replaced."""

    def batch(n: int) -> float:
        start = time.perf_counter()
        out = None
        for _ in range(n):
            out = run()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    jax.block_until_ready(run())
    n = 1
    while (seconds := batch(n)) * n < min_batch_s and n < 256:
        n *= 4
    return statistics.median([seconds] + [batch(n) for _ in range(repeats - 1)])


class Compiler:
    """Lowers and compiles jitted functions in worker threads (XLA compiles without the GIL), in the
    order submitted, while the main thread runs what is ready."""

    def __init__(self, workers: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
        self.pending: list[concurrent.futures.Future] = []

    def submit(
        self, fn, *args, precision: str | None = None, options: dict | None = None, **kwargs
    ) -> concurrent.futures.Future:
        """A future of (compiled, seconds) for
        ``fn.lower(*args, **kwargs).compile(compiler_options=options)``, traced under
        ``jax.default_matmul_precision(precision)`` when given."""

        def work():
            start = time.perf_counter()
            with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
                compiled = fn.lower(*args, **kwargs).compile(compiler_options=options)
            return compiled, time.perf_counter() - start

        future = self.pool.submit(work)
        self.pending.append(future)
        return future

    def cancel_pending(self) -> None:
        """Drop every submitted compilation that has not started (a phase whose deadline passed)."""
        for future in self.pending:
            future.cancel()
        self.pending = [f for f in self.pending if not f.cancelled()]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_XLA_OP = re.compile(
    r"[a-z][\w-]*(\.\d+)?"
)  # an XLA thunk's event on CPU (not the executor's or Python's)
KINDS = (  # (kind, name fragments), first match wins
    ("cache write", ("dynamic-update-slice", "dynamic_update_slice", "scatter")),
    ("slice or copy", ("dynamic_slice", "dynamic-slice", "slice", "copy", "memcpy")),
    ("attention kernel", ("attention",)),
    (
        "matmul",
        ("gemm", "dot", "xmma", "cublas", "cutlass", "nvjet", "ynn", "matmul"),
    ),  # nvjet: cuBLAS, Hopper
    ("sort", ("sort",)),
)


SHORT_OP_US = 5.0  # a kernel this short is mostly its launch and ramp (a few µs on an H200)


def device_profile(run: Callable[[], Any], steps: int, top: int = 8) -> dict:
    """Where one call of ``run`` (``steps`` decode steps) spends device time, from JAX's profiler (a
    Perfetto trace): ms per step per kind of op (``KINDS``, else "other"), ops per step (with the
    timed step, the gap each kernel launch leaves), the ops shorter than ``SHORT_OP_US`` (per step:
    how many, and their ms: the time that fewer, fused ops could save) and the ``top`` names by
    time (None: all; also read by ``benchmarks/batch_decode.py``). On a GPU the kernels of the
    device's stream threads (the "XLA Ops" line if there are none); on a CPU, XLA's thunks."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    meta = [e for e in events if e.get("ph") == "M"]
    devices = {
        e["pid"]
        for e in meta
        if e.get("name") == "process_name" and "/device:" in e.get("args", {}).get("name", "")
    }
    threads = {
        (e["pid"], e["tid"]): e.get("args", {}).get("name", "")
        for e in meta
        if e.get("name") == "thread_name" and e.get("pid") in devices
    }
    lines = [t for t, n in threads.items() if "stream" in n.lower()] or [
        t for t, n in threads.items() if n == "XLA Ops"
    ]
    per_name, ops, short, short_ms = collections.Counter(), 0, 0, 0.0
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X":
            continue
        if devices:
            if (e.get("pid"), e.get("tid")) not in lines:
                continue
        elif not _XLA_OP.fullmatch(name) or name.startswith(("while", "call", "conditional")):
            continue
        per_name[name] += e.get("dur", 0) / 1e3 / steps
        ops += 1
        if e.get("dur", 0) < SHORT_OP_US:
            short += 1
            short_ms += e.get("dur", 0) / 1e3
    kinds = collections.Counter()
    for name, ms in per_name.items():
        lower = name.lower()
        kinds[next((k for k, parts in KINDS if any(p in lower for p in parts)), "other")] += ms
    return {
        "ms_per_step": sum(per_name.values()),
        "ops_per_step": ops / steps,
        "short_ops_per_step": short / steps,
        "short_ops_ms": short_ms / steps,
        "kinds": dict(kinds),
        "top": [[name, ms] for name, ms in per_name.most_common(top)],
        # the trace lines counted (none on a device: every device line's name, to see why)
        "lines": (
            sorted({threads[t] for t in lines}) or [f"none of {sorted(set(threads.values()))}"]
        )
        if devices
        else ["XLA:CPU thunks"],
    }


HLO_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


@dataclasses.dataclass
class Hlo:
    """A compiled program's text by computation: each one's lines, the computation that calls it,
    and the trip count of each while loop's body (1 where XLA knows none)."""

    lines: dict[str, list[str]]
    caller: dict[str, str]
    trips: dict[str, int]

    @classmethod
    def parse(cls, text: str) -> Hlo:
        lines, caller, trips, comp = {}, {}, {}, None
        for line in text.splitlines():
            if line and not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
                comp = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
                lines[comp] = []
            elif comp is not None:
                lines[comp].append(line)
        for name, body in lines.items():
            for line in body:
                for loop in re.findall(r"body=%([\w.\-]+)", line):
                    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                    trips[loop] = int(trip.group(1)) if trip else 1
                for callee in re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", line):
                    caller.setdefault(callee, name)
                for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    for callee in group.split(","):
                        caller.setdefault(callee.strip().lstrip("%"), name)
        return cls(lines, caller, trips)

    def enclosing(self, name: str) -> list[str]:
        """The loop bodies ``name`` runs in, itself first if it is one, outermost last."""
        found = []
        while name is not None:
            found += [name] if name in self.trips else []
            name = self.caller.get(name)
        return found

    def times(self, name: str) -> int:
        """How often a computation runs per call of the program: the trip counts of its loops
        multiplied."""
        return math.prod(self.trips[loop] for loop in self.enclosing(name))


def loop_copies(hlo: str, depth: int = 2) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, shape, times) of each ``copy`` instruction in the bodies of while loops nested
    ``depth`` deep in a compiled program's text, ``times`` the trip count of the loop that holds it:
    with 2, the loops inside the decode loop (the layer scan: what XLA copies in every layer of a
    step)."""
    prog = Hlo.parse(hlo)
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d), prog.trips[name])
        for name, body in prog.lines.items()
        if name in prog.trips and len(prog.enclosing(name)) == depth
        for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S* copy\(", "\n".join(body))
    ]


def copied_bytes(copies: list[tuple[str, tuple[int, ...], int]]) -> int:
    """Bytes the copies of ``loop_copies`` write, each as many times as its loop runs."""
    return sum(HLO_BYTES.get(dtype, 4) * math.prod(shape) * times for dtype, shape, times in copies)


_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)")
_SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}


def _shape_bytes(shape: str) -> int:
    return sum(
        HLO_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _SHAPE.findall(shape)
        if dtype in HLO_BYTES
    )


def _instructions(body: list[str]) -> list[tuple[str, str, str, list[str], str]]:
    """(name, result shape, op, operand names, line) of each instruction."""
    found = []
    for line in body:
        m = _OP.match(line)
        if m:
            name, shape, op, rest = m.groups()
            found.append((name, shape, op, re.findall(r"%([\w.\-]+)", rest.split(")")[0]), line))
    return found


# values whose every element depends on the elements of its operands at the same place (a slice of
# the result reads that slice of them), and reductions, whose slices along kept axes do too
_ELEMENTWISE = frozenset(
    "abs add and broadcast clamp compare convert divide exponential exponential-minus-one log "
    "log-plus-one maximum minimum multiply negate not or power reduce rsqrt select sqrt subtract "
    "tanh".split()
)


def _elements(shape: str) -> int:
    dims = _SHAPE.search(shape)
    return math.prod(int(d) for d in dims.group(2).split(",") if d) if dims else 1


def _fused_reads(fused: list[str], index: int, whole: int) -> int:
    """Bytes a fused computation reads of its parameter ``index``: what its gathers and dynamic
    slices take where it is read only through them (nothing where it is only updated in place),
    and the share of it that a static slice keeps of a value computed from it element by element
    (a loop fusion computes only the elements it outputs); else all of it. A dynamic slice read
    only by gathers in turn counts what they take."""
    ops = _instructions(fused)
    shapes = {n: shape for n, shape, *_ in ops}
    roots = {n for n, *_, line in ops if line.lstrip().startswith("ROOT")}

    def reads(names: set, size: float, direct: bool = True) -> float:
        for n, _, op, args, _ in ops:  # its bitcasts and reshapes are it
            if op in ("bitcast", "reshape") and args and args[0] in names:
                names.add(n)
        if names & roots:
            return size
        read = 0.0
        for n, shape, op, args, _ in ops:
            for i, arg in enumerate(args):
                if arg not in names or n in names:
                    continue
                if i == 0 and op == "gather":
                    read += _shape_bytes(shape)
                elif i == 0 and op == "dynamic-slice":
                    read += reads({n}, _shape_bytes(shapes[n]))
                elif i == 0 and op == "slice":
                    read += reads({n}, size * _elements(shape) / _elements(shapes[arg]), False)
                elif op in _ELEMENTWISE:
                    read += reads({n}, size, False)
                elif not (direct and i == 0 and op in ("scatter", "dynamic-update-slice")):
                    return size
        return min(read, size)

    return round(
        reads(
            {n for n, _, op, _, line in ops if op == "parameter" and f"parameter({index})" in line},
            whole,
        )
    )


def _count(
    prog: Hlo,
    comp: str,
    key: str,
    times: int,
    traffic: dict[str, float],
    *,
    loops: bool = True,
    stacked: int = 0,
    prefix: str = "",
    items: list | None = None,
) -> None:
    """Add computation ``comp``'s bytes, run ``times`` times, to ``traffic[key]``; its conditionals'
    branches to keys of their own (``prefix`` + the conditional and its branch), its loops (unless
    not ``loops``) to ``key`` times their trips. With ``stacked`` (a loop's trip count), a custom
    call's operand whose leading axis is that long counts one trip's share: a kernel handed the
    whole stacked cache reads its layer in place. ``items``, if given, receives (bytes, key,
    instruction, op, its line) of each instruction counted."""
    traffic[key] += 0.0  # a branch that moves nothing is listed too
    ops = _instructions(prog.lines[comp])
    shapes = {n: shape for n, shape, *_ in ops}
    for name, shape, op, args, line in ops:
        if op in _SKIP:
            continue
        if op == "while":
            if loops:
                body, trips = _loop(prog, line)
                _count(
                    prog,
                    body,
                    key,
                    times * trips,
                    traffic,
                    stacked=stacked,
                    prefix=prefix,
                    items=items,
                )
            continue
        if op == "conditional":  # true / false, or the branch's index
            branches = re.findall(r"(true|false)_computation=%([\w.\-]+)", line) or [
                (str(i), b.strip().lstrip("%"))
                for g in re.findall(r"branch_computations=\{([^}]*)\}", line)
                for i, b in enumerate(g.split(","))
            ]
            for label, branch in branches:
                branch_key = f"{prefix}{name} {label}"
                _count(
                    prog,
                    branch,
                    branch_key,
                    times,
                    traffic,
                    stacked=stacked,
                    prefix=prefix,
                    items=items,
                )
            continue
        fused = re.search(r"calls=%([\w.\-]+)", line)
        # a fusion's instructions, or the instruction alone as if it were one
        fused = (
            prog.lines.get(fused.group(1))
            if op == "fusion" and fused
            else [f"ROOT %x = {shape} {op}({', '.join(f'%p{i}' for i in range(len(args)))})"]
            + [f"%p{i} = s32[] parameter({i})" for i in range(len(args))]
        )
        out = _shape_bytes(shape)
        root = next((f for f in fused if f.lstrip().startswith("ROOT")), "")
        if re.search(r" (scatter|dynamic-update-slice)\(", root):
            out = 0  # written in place: its updates are counted as read
        if "__cublas" in line or any("__cublas" in f for f in fused):
            out -= sum(_shape_bytes(s8) for s8 in re.findall(r"\bs8\[[\d,]*\]", shape))  # workspace
        reads = 0
        for i, a in enumerate(args):
            whole = _shape_bytes(shapes.get(a, ""))
            dims = _SHAPE.search(shapes.get(a, ""))
            if (
                op == "custom-call"
                and stacked
                and dims
                and dims.group(2).split(",")[0] == str(stacked)
            ):
                reads += whole // stacked
            else:
                reads += _fused_reads(fused, i, whole)
        traffic[key] += times * (out + reads)
        if items is not None:
            items.append((times * (out + reads), key, name, op, line))


def _loop(prog: Hlo, line: str) -> tuple[str, int]:
    """(body, trip count) of the while instruction ``line``."""
    body = re.search(r"body=%([\w.\-]+)", line).group(1)
    return body, prog.trips.get(body, 1)


def _decode_loop(prog: Hlo) -> str:
    """The decode loop's body: the outermost loop around the layer scan."""
    return next(prog.enclosing(name)[-1] for name in prog.trips if len(prog.enclosing(name)) == 2)


def step_traffic(hlo: str, items: list | None = None) -> dict[str, float]:
    """Bytes read and written per step, about, by the decoding loop's body outside its loops
    (key "step": the instructions that always run) and by each branch of its conditionals (key:
    the conditional and "true", "false" or the branch's index; a step runs one branch of each),
    the loops inside a branch times their trip counts. Each instruction counts its result and its
    operands; a fusion counts of an operand only what its gathers, dynamic slices and static slices
    (of values computed from it element by element) read of it, and nothing for a result it
    updates in place (a scatter's buffer). From the program's text:
    no timing, and XLA may keep some of it in the caches. ``items``: as ``_count``'s."""
    prog = Hlo.parse(hlo)
    traffic: dict[str, float] = collections.defaultdict(float)
    _count(prog, _decode_loop(prog), "step", 1, traffic, loops=False, items=items)
    return dict(traffic)


def loop_traffic(hlo: str, items: list | None = None) -> dict[str, float]:
    """Bytes read and written per step, about, by each loop of the decoding loop's body (key
    "loop" and its trip count: the layer scan is the one of as many trips as layers), every trip
    counted as ``step_traffic`` counts, and by each branch of the conditionals inside it (key: the
    loop's, then the conditional's; a trip runs one branch of each). A custom call handed an
    operand stacked over the loop's trips (a kernel reading its layer of the stacked cache in
    place) counts one trip's share of it. ``items``: as ``_count``'s."""
    prog = Hlo.parse(hlo)
    traffic: dict[str, float] = collections.defaultdict(float)
    for name, _, op, _, line in _instructions(prog.lines[_decode_loop(prog)]):
        if op == "while":
            body, trips = _loop(prog, line)
            key = f"loop {name} ({trips} trips)"
            _count(prog, body, key, trips, traffic, stacked=trips, prefix=f"{key} / ", items=items)
    return dict(traffic)


def memory_stats() -> dict[str, int]:
    """The default device's allocator figures (bytes_limit, bytes_in_use, peak_bytes_in_use and, if
    it gives it, largest_free_block_bytes), {} where the platform gives none (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    keys = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_free_block_bytes")
    return {k: int(stats[k]) for k in keys if k in stats}


def decode_attention() -> tuple[str | None, str]:
    """(impl, why) of the decode steps' attention in the layers and model parts: None (the
    platform's kernel) when the decode kernel, reading the middle layer of a stack of three at the
    8B's heads in bfloat16, one row over 16K slots (32 splits, as a batch-1 step over a long cache:
    ``gpu_common.decode_splits``), runs here and matches XLA's; else "xla" for every row, so that
    one failed kernel does not fail every decode row. (On a CPU None is XLA's attention: the check
    runs the same steps, at 128 slots.)"""
    from kvjax.kernels import decode_attention_with_scores

    cpu = jax.default_backend() == "cpu"
    L, B, H, Hk, K, S = 3, 1, 32, 8, 128, 128 if cpu else 16384
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (B, 1, H, K), jnp.bfloat16)
    k, v = (jax.random.normal(key, (L, B, Hk, S, K), jnp.bfloat16) for key in keys[1:])
    slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, Hk, S))
    query_pos = jnp.full((B, 1), S - 1, jnp.int32)

    def out(impl):
        attend = lambda *a: decode_attention_with_scores(*a, layer=jnp.int32(1), impl=impl)[0]  # noqa: E731
        return jax.jit(attend)(q, k, v, slot_pos, query_pos).astype(jnp.float32)

    try:
        got, want = out(None), out("xla")
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    except Exception as e:  # noqa: BLE001 - the reason is reported, the rows run on XLA
        return (
            "xla",
            f"the decode kernel failed, every row runs XLA's attention: {error_text(e, 300)}",
        )
    if not err <= 5e-2:
        return "xla", f"the decode kernel is off XLA's by {err:.2e}, every row runs XLA's attention"
    what = "the default attention (XLA's on CPU)" if cpu else "the decode kernel"
    return None, f"{what} over a stacked layer matches XLA's (max error {err:.1e} of the largest)"


@dataclasses.dataclass
class Ceilings:
    copy_gb_s: float  # device-to-device copy, bytes read plus bytes written per second
    copy_bytes: int
    read_gb_s: float  # a reduction of the same array: bytes read per second
    read_bytes: int
    matmul_tflops: float  # bf16 square matrix product
    matmul_n: int


def measure_ceilings(smoke: bool) -> Ceilings:
    """The ceilings of METHOD.md on this device: a copy of a large array (read + written bytes over
    the median time; fresh random data, never zeros), a read of the same array (its rows of 64K
    summed in float32: the bytes read over the median time; the partial sums written, 1/32768 of
    that, are not counted) and a bf16 n×n×n matrix product."""
    cpu = jax.default_backend() == "cpu"
    # bf16 elements: 8 MiB (smoke), 256 MiB on a CPU, 4 GiB on a GPU
    n_copy = (1 << 22) if smoke else (1 << 27) if cpu else (1 << 31)
    x = jax.random.normal(jax.random.key(1), (n_copy,), jnp.bfloat16)
    copy = jax.jit(
        lambda a: a * jnp.bfloat16(-1)
    )  # one read, one write; not elided like a plain copy
    seconds = median_seconds(functools.partial(copy, x), 7)
    copy_bytes = 2 * n_copy * 2
    read = jax.jit(lambda a: jnp.sum(a.reshape(-1, 1 << 16), axis=1, dtype=jnp.float32))
    read_s = median_seconds(functools.partial(read, x), 7)
    read_bytes = n_copy * 2
    del x
    n = 512 if smoke else 1024 if cpu else 8192
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (2, 3))
    mm = jax.jit(lambda a, b: a @ b)
    mm_s = median_seconds(lambda: mm(a, b), 7)
    return Ceilings(
        copy_gb_s=copy_bytes / seconds / 1e9,
        copy_bytes=copy_bytes,
        read_gb_s=read_bytes / read_s / 1e9,
        read_bytes=read_bytes,
        matmul_tflops=2 * n**3 / mm_s / 1e12,
        matmul_n=n,
    )


def floors(ceilings: Ceilings, nbytes: float) -> dict[str, float]:
    """A step's floor two ways: ``nbytes`` over the copy rate (``floor_s``: the conservative one,
    the copy counting its reads and writes) and over the read rate (``read_floor_s``)."""
    return {
        "floor_s": nbytes / (ceilings.copy_gb_s * 1e9),
        "read_floor_s": nbytes / (ceilings.read_gb_s * 1e9),
    }


# the memory bandwidth a device's specification gives, GB/s (by a name in its device kind)
SPEC_GB_S = {"H200": 4800.0}


def device_text() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')} x{jax.device_count()}"


def guarded(
    results: Results, part: str, label: dict[str, Any], fn: Callable[[], dict[str, Any]]
) -> dict | None:
    """Run one measurement; its row (or its error, named) goes to ``results``. Never raises but
    KeyboardInterrupt."""
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 - a failure on first contact is a result to report, not a crash
        log(f"{part} {label}: FAILED {error_text(e, 300)}")
        if os.environ.get("KVJAX_GPU_TRACEBACKS"):
            traceback.print_exc()
        results.add(part, {**label, "error": error_text(e)})
        return None
    results.add(part, {**label, **row})
    return row
