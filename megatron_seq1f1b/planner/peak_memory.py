"""Peak memory from real allocations, never from our own bookkeeping.

* GPU: ``torch.cuda.max_memory_allocated`` (reset with
  ``reset_peak_memory_stats``): every byte the caching allocator handed out.
* CPU: the kernel's resident-set high-water mark ``VmHWM`` of this process,
  reset by writing ``5`` to ``/proc/self/clear_refs``. Freed tensors leave the
  resident set only if glibc returns their pages, so launch with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (allocations of 64 KiB and more then use
  ``mmap`` and are unmapped on free). Error bars: page granularity (4 KiB),
  allocator caching below the threshold (small tensors), and the Python
  interpreter's own growth; compare runs of one process layout, and read the
  peak *above* the resident set at the start of the measured window.
"""

from __future__ import annotations

import os

import torch

MMAP_THRESHOLD_HINT = "MALLOC_MMAP_THRESHOLD_=65536"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


class PeakMemory:
    """reset() then peak_bytes(): the high-water mark of real allocations since reset."""

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.baseline = 0
        if not self.on_gpu and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            self.warning = (
                f"CPU peak memory is not valid without {MMAP_THRESHOLD_HINT}: freed tensors "
                "stay resident and are reused, so a peak above the start of a window "
                "undercounts (often near 0) and the resident high-water mark overcounts; "
                f"launch with {MMAP_THRESHOLD_HINT}"
            )
        else:
            self.warning = None

    def current_bytes(self) -> int:
        if self.on_gpu:
            return torch.cuda.memory_allocated(self.device)
        return _status_kib("VmRSS") * 1024

    def reset(self) -> None:
        """Start a new window; the baseline is what is resident now."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        self.baseline = self.current_bytes()

    def peak_bytes(self) -> int:
        """Highest allocation (GPU) / resident set (CPU) since the last reset."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024

    def peak_above_baseline(self) -> int:
        return max(self.peak_bytes() - self.baseline, 0)


class SavedActivations:
    """High-water mark of the bytes autograd keeps for backward: the activations a
    pipeline stage holds, counted from the tensors themselves.

    Inside ``with meter:`` every tensor saved for backward is counted once per storage
    (views of one buffer, such as the K/V cache's, count once, at the storage's size)
    from when it is first saved until the last saved reference to it is freed;
    parameters (``exclude``) are not counted. On CPU this is the honest equivalent of
    the CUDA allocator's peak for activations: the resident set cannot tell (glibc
    keeps freed pages; small tensors never leave its arenas), while this counts the
    same bytes whatever the allocator does. What it does not see: tensors held
    outside autograd (a pipeline's outputs waiting for their send, received tensors
    not yet used) and temporaries that die within one operation.
    """

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [saved references, bytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = None

    def _pack(self, tensor):
        import weakref

        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or pointer in self._excluded:
            return tensor
        entry = self._live.get(pointer)
        if entry is None:
            self._live[pointer] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        weakref.finalize(tensor, self._release, pointer)
        return tensor

    def _release(self, pointer: int) -> None:
        entry = self._live.get(pointer)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[pointer]
            self.live_bytes -= entry[1]

    def reset(self) -> None:
        """Start a new window at what is alive now."""
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
