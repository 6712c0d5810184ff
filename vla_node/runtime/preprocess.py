"""Camera frames (HxWx3 uint8 RGB) -> model pixels [N, 3, S, S] in [-1, 1].

As the official MolmoBot preprocessing: the whole frame stretched to S x S with bilinear
interpolation without antialiasing, rounded back to uint8 values, then x / 255 * 2 - 1. The
reference runs it on the CPU; the device path stages uint8 frames in pinned memory (one host
copy), uploads them without blocking, and resizes/normalises on the device. Frames that already lie
in page-locked memory (the engine server's shared frame buffers, registered by page_lock) upload
straight from there: no host copy.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def _resized(frames_u8: torch.Tensor, size: int) -> torch.Tensor:
    """[N, H, W, 3] uint8 -> [N, 3, size, size] float32 holding the rounded uint8 values."""
    x = frames_u8.permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=False, align_corners=False)
    return x.round().clamp(0, 255)


def resize_u8(frames_u8: torch.Tensor, size: int) -> torch.Tensor:
    """frames_u8 [N, H, W, 3] -> [N, 3, size, size] uint8, as resize_normalize resizes (the trainer
    keeps frames this way)."""
    return _resized(frames_u8, size).to(torch.uint8)


def resize_normalize(frames_u8: torch.Tensor, size: int) -> torch.Tensor:
    """frames_u8 [N, H, W, 3] uint8 -> [N, 3, size, size] float32 in [-1, 1] (SigLIP mean/std 0.5)."""
    return _resized(frames_u8, size) / 255 * 2 - 1


def preprocess_reference(images: Sequence[np.ndarray], size: int) -> torch.Tensor:
    """The CPU reference every other path is compared against."""
    return resize_normalize(torch.from_numpy(np.stack(images)), size)


class DeviceStaging:
    """Pinned host buffer -> device buffer for up to `capacity` frames of one camera size."""

    def __init__(self, capacity: int, height: int, width: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.empty((capacity, height, width, 3), dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.empty((capacity, height, width, 3), dtype=torch.uint8, device=device)
        self.uploaded: Optional[torch.cuda.Event] = None   # the last upload's end (CUDA)

    def upload(self, images: Sequence[np.ndarray]) -> None:
        """Copy frames into the pinned buffer (the one host copy) and start the upload. Later
        work on the current stream orders after it; the next upload waits for this one to have
        left the pinned buffer before it writes there (a query of several vision batches)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        host = self.host.numpy()
        for i, img in enumerate(images):   # frame by frame: one frame's upload runs while the next is copied
            if self.device.type == "cuda" and img.flags.writeable and img.flags.c_contiguous and \
                    torch.from_numpy(img).is_pinned():
                # Straight from the caller's page-locked memory: the query waits for the device before
                # it returns, so the caller's frame is read before it may change.
                self.dev[i].copy_(torch.from_numpy(img), non_blocking=True)
                continue
            host[i] = img
            self.dev[i].copy_(self.host[i], non_blocking=True)
        if self.device.type == "cuda":
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()


def page_lock(array: np.ndarray) -> bool:
    """Register `array`'s memory (C-contiguous: a frame buffer another process shares, say) with
    the CUDA driver as page-locked, so that DeviceStaging uploads frames from it straight to the
    device. The copy of a DROID query's four 640 x 480 frames into the pinned buffer was 0.85 of the
    1.15 ms of host work outside its stages on the 2-core CPU VM (cProfile, 20 queries); on the H200
    the preprocess stage took 0.45-1.59 ms (BENCHMARKS.md). False where it cannot be (no CUDA, no
    cuda-python, a driver error): uploads then copy as before. page_unlock before the memory goes."""
    try:
        from cuda.bindings import driver

        flags = driver.CU_MEMHOSTREGISTER_PORTABLE
        (err,) = driver.cuMemHostRegister(array.ctypes.data, array.nbytes, flags)
    except Exception:   # cuda-python missing, or no driver: the copy it was
        return False
    return err == driver.CUresult.CUDA_SUCCESS   # driver errors leave the runtime's error state alone


def page_unlock(array: np.ndarray) -> None:
    from cuda.bindings import driver

    driver.cuMemHostUnregister(array.ctypes.data)
