"""Per-rank peak memory of a measured span of code and of named regions inside it.

```python
meter = MemoryMeter(device)            # once, early (see "absolute" below)
with meter.measure() as m:             # e.g. one training step
    loss = forward_backward()
    with m.region("optim"):
        opt.step()
m.peak_bytes()                  # peak live bytes over the span (absolute, see below)
m.peak_bytes("optim")           # peak live bytes inside the region
m.peak_delta_bytes("optim")     # that peak minus the live bytes at the region's start
m.peak_delta_bytes()            # span peak minus the live bytes at the span's start
m.summary()                     # {"step_peak_mib": ..., "optim_peak_delta_mib": ..., ...}
rank_metrics(gather_peaks(m.summary()))  # recipes.ranks: {"memory/rank_0/step_peak_mib": ...}
```

How it measures
- CUDA: the caching allocator's own statistics. At every span or region boundary the meter
  reads `max_memory_allocated`, folds it into every open span/region, then calls
  `reset_peak_memory_stats` and reads `memory_allocated`, so nested regions and the whole span
  all get exact peaks. Absolute figures are the allocator's `memory_allocated`. Side effect: the
  device's peak statistics are reset at each boundary. Memory outside the caching allocator
  (NCCL's own buffers, CUDA context) is not counted.
- CPU: there is no allocator statistics API, so a measured span runs the torch profiler with
  `profile_memory=True`, restricted to user scopes (aten ops are not recorded, which halves the
  overhead), and reads each `[memory]` event's "Total Allocated": c10's CPU allocator counter.
  That counter is never reset, so the span and each region boundary allocate-and-free a
  *marker* tensor of a unique odd byte size; the marker's event gives the live bytes at that
  instant and its position in the event stream delimits the region. A free event's
  "Total Allocated + bytes freed" is the live total just before the free, which is also a peak
  candidate (it reveals buffers allocated on other threads).
  By default c10 updates the counter only on threads where the profiler is active, so a buffer
  freed on a gloo or DTensor worker thread is never subtracted (peaks over-reported, phantom
  retained bytes). `enable_cpu_allocation_tracking()` (called by `MemoryMeter` on CPU) sets
  c10's exported boolean `FLAGS_caffe2_report_cpu_memory_usage` through ctypes, which makes
  every thread update the counter. It stays on for the rest of the process (switching it off
  would orphan buffers allocated while it was on); cost measured here: ~0.7 us per CPU
  allocation+free pair (0.63 -> 1.38 us for `torch.empty(4096)`).
- The meter also sets `KINETO_LOG_LEVEL=6` (unless already set) before its first profiler
  session: otherwise kineto prints two "USDT ... profiler_start/stop" lines per measured step.

What "absolute" means on CPU: live bytes of tensors allocated through c10's CPU allocator on
any thread *since tracking was enabled* (the first CPU `MemoryMeter` or an explicit
`enable_cpu_allocation_tracking()` call). Create the meter before building the model and
optimizer if the absolute figure should include them. Deltas are exact for tensors
allocated after that; freeing an older tensor is invisible to the counter (it does not lower
the figures), so a region that frees an old 8 MiB tensor and then allocates 8 MiB reads +8 MiB.

Accuracy (tests/distributed/test_memory.py): an 8 MiB tensor in a region gives a delta of exactly
8 MiB; three sequential 4 MiB alloc/free pairs peak at 4 MiB, not 12; a 16 MiB tensor freed on a
worker thread leaves no phantom bytes, and a 24 MiB tensor allocated on a worker and freed on
the measuring thread shows as a 24 MiB peak; in a 2-rank gloo world the rank holding an extra
32 MiB shows exactly 32 MiB more; all_to_all_single (sync and async) shows exactly its 8 MiB
receive buffer; all_gather_into_tensor shows its 8 MiB receive buffer plus gloo's 8 MiB flat
staging copy (a real allocation of gloo's CPU path that NCCL does not make).

Caveats (CPU)
- A buffer allocated *and* freed on another thread while the measuring thread makes no
  allocation or free (e.g. a staging buffer inside a gloo worker while the caller blocks in
  `wait()`) is counted correctly but its transient peak can be missed: the profiler reports
  events of the measuring thread only. A buffer live at any allocation/free on the measuring
  thread, or freed on it, is seen.
- A tensor whose last Python reference is dropped is still live while a gloo Work (or another
  thread) holds it; such a tensor is freed, and counted as freed, a little later on a worker
  thread. Region starts right after async collectives can therefore include it: keep the
  buffers referenced, or compare against a quiet point (e.g. the span start), when exact
  per-region figures matter.
- Only c10 CPU-allocator storage is counted: not gloo's internal transport buffers, oneDNN
  scratch space, Python objects or pinned host memory.
- One profiler at a time per process: `measure()` refuses to start inside another profiler,
  and the body must not start one.
- Regions must be entered on the thread that entered `measure()`.
- c10 logs one "Memory block of unknown size was allocated before the profiling started"
  warning per 1000 frees of blocks allocated before tracking was enabled; it is harmless.

Overhead of one measured step (CPU; how: a script timing the same step 40 times
unmeasured and 40 times inside `with meter.measure() as m:` with an "optim" region, including
the analysis at exit; median `time.process_time` of the process, as wall time was disturbed by
other jobs on this 2-core machine, torch 2.13, 1 intra-op thread):
- empty span: 0.3 ms.
- small MLP step (4 blocks Linear 256->1024, GELU, Linear 1024->256; batch 64; fwd + bwd +
  AdamW; ~490 allocation events): 18-27 ms -> +3 to +7 ms.
- many small ops (200 tensors of 64x64: mul, sign, add_, matmul; ~2000 allocation events):
  3.5 ms -> +8 to +12 ms.
(Load average 6-16 from other jobs during these runs; wall-time overheads were up to 2x.)
So the cost is about 5-12 us per CPU allocation or free inside the span (profiler recording and
post-processing ~1.5 us, reading the events from Python ~2.5 us, measured on an idler machine)
plus 0.3 ms per span; the full torch profiler (recording aten ops too) cost about twice as
much. For a large step, measure every N steps. Turning c10's cross-thread tracking on costs
~0.7 us per allocation + free for the rest of the process, measured or not. CUDA: four
allocator queries per boundary, negligible.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from recipes.units import MiB

# Marker tensors: uint8 tensors of odd byte sizes 20011, 20013, ... (one per boundary in a span).
# A real allocation of exactly such a size that is also freed right after is what could confuse
# the search; the search only looks between consecutive markers.
_MARKER_BASE_BYTES = 20_011
_MARKER_STRIDE_BYTES = 2
_REPORT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"

_tracking_lock = threading.Lock()
_tracking_state: bool | None = None


def libc10_path() -> str | None:
    """The c10 library next to torch's, whose report flag CPU tracking sets (None: not found)."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            return path
    return None


def _set_report_flag() -> bool:
    path = libc10_path()
    if path is None:
        warnings.warn(
            "recipes.memory: libc10 not found next to torch; CPU frees on worker "
            "threads will not be subtracted (peaks over-reported)",
            stacklevel=3,
        )
        return False
    try:
        # dlopen of an already loaded library returns torch's own copy, so this is its flag.
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(path), _REPORT_FLAG)
    except (OSError, ValueError) as err:
        warnings.warn(
            f"recipes.memory: cannot set {_REPORT_FLAG} ({err}); CPU frees on worker "
            "threads will not be subtracted (peaks over-reported)",
            stacklevel=3,
        )
        return False
    flag.value = True
    return True


def enable_cpu_allocation_tracking() -> bool:
    """Make c10's CPU allocation counter see allocations and frees on every thread.

    Sets c10's `FLAGS_caffe2_report_cpu_memory_usage` (no Python API; set through ctypes) for the
    rest of the process. Idempotent; returns whether the flag is set. Call it early (before
    building the model) for absolute CPU figures to include everything.
    """
    global _tracking_state
    with _tracking_lock:
        if _tracking_state is None:
            _tracking_state = _set_report_flag()
        return _tracking_state


@dataclass
class _Scope:
    """One entry of the span (name None) or of a region: live bytes at start/end, peak."""

    name: str | None
    start: int = 0
    end: int = 0
    peak: int = 0
    start_marker: int = -1  # CPU: marker indices delimiting the scope
    end_marker: int = -1


class MemoryMeter:
    """Measures peak memory of spans of code on one device (a CPU or a CUDA device).

    `device` is anything `torch.device` accepts ("cpu", "cuda", "cuda:1", a torch.device);
    "cuda" without an index means the current CUDA device.
    """

    def __init__(self, device: torch.device | str | int = "cpu") -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter supports cpu and cuda devices, got {device}")
        self.device = device
        self.cpu_tracking = enable_cpu_allocation_tracking() if device.type == "cpu" else False

    def measure(self, name: str = "step") -> Measurement:
        """A context manager measuring its body; `name` keys the span in `summary()`."""
        return Measurement(self, name)

    def __repr__(self) -> str:
        return f"MemoryMeter({self.device})"


class Measurement:
    """Peak memory of one measured span and of the regions entered inside it.

    Figures are available after the `with` block has exited normally.
    """

    def __init__(self, meter: MemoryMeter, name: str) -> None:
        self.meter = meter
        self.name = name
        self._scopes: list[_Scope] = []  # the span first, then regions in entry order
        self._open: list[_Scope] = []
        self._state = "new"
        self._thread: int | None = None
        self._markers = 0
        self._profiling = False

    # -- measuring -------------------------------------------------------------------------
    def __enter__(self) -> Measurement:
        if self._state != "new":
            raise RuntimeError("a Measurement can be entered only once; call meter.measure()")
        self._thread = threading.get_ident()
        if self.meter.device.type == "cpu":
            _start_cpu_profiler()
            self._profiling = True
        self._state = "running"
        self._open_scope(None)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._state == "running" and exc_type is None:
                while len(self._open) > 1:  # regions left open by a generator, say
                    self._close_scope()
                self._close_scope()
        finally:
            result = _stop_cpu_profiler() if self._profiling else None
            self._profiling = False
        if exc_type is not None:
            self._state = "failed"
            return
        if result is not None:
            _analyze_cpu(result, self._scopes, self._markers)
        self._state = "done"

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Measure the body as region `name`; regions nest and a name may repeat."""
        if self._state != "running":
            raise RuntimeError("region() is only valid inside `with meter.measure()`")
        if threading.get_ident() != self._thread:
            raise RuntimeError("region() must be entered on the thread that entered measure()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"region name must be a non-empty string, got {name!r}")
        scope = self._open_scope(name)
        try:
            yield
        finally:
            if self._open and self._open[-1] is scope:
                self._close_scope()

    def _open_scope(self, name: str | None) -> _Scope:
        scope = _Scope(name)
        if self.meter.device.type == "cpu":
            scope.start_marker = self._mark()
        else:
            scope.start = scope.peak = self._cuda_boundary()
        self._scopes.append(scope)
        self._open.append(scope)
        return scope

    def _close_scope(self) -> None:
        scope = self._open[-1]
        if self.meter.device.type == "cpu":
            scope.end_marker = self._mark()
        else:
            scope.end = self._cuda_boundary()
        self._open.pop()

    def _mark(self) -> int:
        index = self._markers
        self._markers += 1
        marker = torch.empty(marker_bytes(index), dtype=torch.uint8)
        del marker
        return index

    def _cuda_boundary(self) -> int:
        """Fold the peak since the last boundary into every open scope; restart the peak."""
        device = self.meter.device
        peak = torch.cuda.max_memory_allocated(device)
        for scope in self._open:
            scope.peak = max(scope.peak, peak)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)

    # -- results ---------------------------------------------------------------------------
    @property
    def regions(self) -> list[str]:
        """Region names in order of first entry."""
        return list(dict.fromkeys(s.name for s in self._scopes if s.name is not None))

    def _entries(self, region: str | None) -> list[_Scope]:
        if self._state != "done":
            raise RuntimeError(
                "memory figures are available after `with meter.measure()` exits normally"
                f" (state: {self._state})"
            )
        entries = [s for s in self._scopes if s.name == region]
        if not entries:
            raise KeyError(f"no region {region!r} was measured; regions: {self.regions}")
        return entries

    def peak_bytes(self, region: str | None = None) -> int:
        """Peak live bytes over the span (region None) or over every entry of `region`."""
        return max(s.peak for s in self._entries(region))

    def peak_delta_bytes(self, region: str | None = None) -> int:
        """Peak minus live bytes at the start (largest over the region's entries)."""
        return max(s.peak - s.start for s in self._entries(region))

    def start_bytes(self, region: str | None = None) -> int:
        """Live bytes when the span (or the region's first entry) started."""
        return self._entries(region)[0].start

    def end_bytes(self, region: str | None = None) -> int:
        """Live bytes when the span (or the region's last entry) ended."""
        return self._entries(region)[-1].end

    def summary(self, unit: int = MiB, suffix: str = "mib") -> dict[str, float]:
        """`{<span>_peak_<suffix>, <span>_peak_delta_<suffix>, <region>_peak_..., ...}`."""
        out: dict[str, float] = {}
        for key, region in [(self.name, None)] + [(r, r) for r in self.regions]:
            out[f"{key}_peak_{suffix}"] = self.peak_bytes(region) / unit
            out[f"{key}_peak_delta_{suffix}"] = self.peak_delta_bytes(region) / unit
        return out

    def __repr__(self) -> str:
        if self._state != "done":
            return f"Measurement({self.name!r}, {self._state})"
        parts = [f"{k}={v:.2f}" for k, v in self.summary().items()]
        return f"Measurement({self.name!r}, {', '.join(parts)})"


# -- CPU: profiler session and event analysis ----------------------------------------------
def marker_bytes(index: int) -> int:
    """Bytes of marker `index`, the index-th boundary of a span (the sizes above)."""
    return _MARKER_BASE_BYTES + _MARKER_STRIDE_BYTES * index


def _profiler_config():
    from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig

    # state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, exp.
    return ProfilerConfig(
        ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig()
    )


def _start_cpu_profiler() -> None:
    from torch._C._autograd import _enable_profiler, _prepare_profiler, _profiler_enabled
    from torch._C._profiler import ProfilerActivity, RecordScope

    if _profiler_enabled():
        raise RuntimeError(
            "MemoryMeter on CPU needs the torch profiler, and another profiler is active"
        )
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(_profiler_config(), activities)
    # Only user scopes: memory events are still reported, aten ops are not recorded.
    _enable_profiler(_profiler_config(), activities, {RecordScope.USER_SCOPE})
    torch.autograd.profiler._run_on_profiler_start()


def _stop_cpu_profiler():
    from torch._C._autograd import _disable_profiler

    try:
        return _disable_profiler()
    finally:
        torch.autograd.profiler._run_on_profiler_stop()


def _cpu_allocation_events(result: Any) -> list[tuple[int, int, int, int, int]]:
    """(time_ns, signed size, counter after, ptr, thread) of CPU allocations, by time."""
    from torch._C._profiler import _EventType

    allocation = _EventType.Allocation
    events = []
    stack = list(result.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":  # CUDA tensors in a CPU span report here too
                events.append(
                    (
                        event.start_time_ns,
                        fields.alloc_size,
                        fields.total_allocated,
                        fields.ptr,
                        event.start_tid,
                    )
                )
        else:
            stack.extend(event.children)
    events.sort(key=lambda e: e[0])
    return events


def _analyze_cpu(result: Any, scopes: list[_Scope], n_markers: int) -> None:
    events = _cpu_allocation_events(result)
    # A peak candidate per event: live bytes just after an allocation, just before a free.
    candidate = [total if size > 0 else total - size for _, size, total, _, _ in events]
    alloc_at: list[int] = []  # marker index -> event index of its allocation
    free_at: list[int] = []
    live_at: list[int] = []  # marker index -> live bytes (marker excluded)
    pos = 0
    for index in range(n_markers):
        size = marker_bytes(index)
        found = None
        for i in range(pos, len(events)):
            if events[i][1] != size:
                continue
            # A marker is freed right after its allocation: the next event of its thread is
            # the free of the same pointer. A real tensor of the same size is not.
            tid = events[i][4]
            j = next((j for j in range(i + 1, len(events)) if events[j][4] == tid), None)
            if j is not None and events[j][1] == -size and events[j][3] == events[i][3]:
                found = (i, j)
                break
        if found is None:
            raise RuntimeError(
                f"MemoryMeter: boundary marker {index} ({size} bytes) is missing from the "
                "profiler's memory events; was the profiler stopped inside the span?"
            )
        i, j = found
        live = events[i][2] - size
        candidate[i] = live
        candidate[j] = events[j][2]
        alloc_at.append(i)
        free_at.append(j)
        live_at.append(live)
        pos = j + 1
    for scope in scopes:
        first, last = scope.start_marker, scope.end_marker
        scope.start, scope.end = live_at[first], live_at[last]
        inside = candidate[free_at[first] + 1 : alloc_at[last]]
        scope.peak = max(scope.start, scope.end, max(inside, default=0))
