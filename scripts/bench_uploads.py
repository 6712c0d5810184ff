"""Host-to-device bandwidth of a query's camera frames (640 x 480 RGB uint8 from page-locked memory,
as vla-bench gives them): what limits the preprocess stage's uploads (4 x 38 us at DROID on an H100,
~24 GB/s: the link's ceiling, or one copy engine's?). Ways, each timed by events around the
uploads (us, median of 20 after 3 warm): the frames one after another on one stream (the engine's
DeviceStaging.upload), split over 2 and 4 streams, and all of them as one copy of the same bytes.

    PYTHONPATH=$PWD python3 scripts/bench_uploads.py [--frames 4,8] [--json F]
"""
import argparse
import json
import statistics

import torch

from vla_node.tools.bench import machine

HEIGHT, WIDTH = 480, 640


def upload_us(frames: list[torch.Tensor], dev: torch.Tensor, streams: int, one_copy: bool, runs: int = 20) -> float:
    """Median us from an event before the first upload to one after the last has landed."""
    main = torch.cuda.current_stream()
    side = [torch.cuda.Stream() for _ in range(streams)]
    flat = torch.stack(frames).pin_memory() if one_copy else None
    times = []
    for i in range(runs + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if one_copy:
            dev.copy_(flat, non_blocking=True)
        else:
            for s in side:
                s.wait_stream(main)
            for k, frame in enumerate(frames):
                with torch.cuda.stream(side[k % streams]):
                    dev[k].copy_(frame, non_blocking=True)
            for s in side:
                main.wait_stream(s)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", default="4,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    for n in (int(f) for f in args.frames.split(",")):
        frames = [torch.randint(0, 256, (HEIGHT, WIDTH, 3), dtype=torch.uint8).pin_memory() for _ in range(n)]
        dev = torch.empty((n, HEIGHT, WIDTH, 3), dtype=torch.uint8, device="cuda")
        ways = {"1 stream": upload_us(frames, dev, 1, False), "2 streams": upload_us(frames, dev, 2, False),
                "4 streams": upload_us(frames, dev, 4, False), "one copy": upload_us(frames, dev, 1, True)}
        assert all(torch.equal(dev[k].cpu(), frames[k]) for k in range(n))
        rows[n] = ways
    nbytes = HEIGHT * WIDTH * 3
    print(f"{'frames':>6} " + " ".join(f"{w + ' us':>13} {'GB/s':>6}" for w in next(iter(rows.values()))))
    for n, ways in rows.items():
        print(f"{n:>6} " + " ".join(f"{us:>13.1f} {n * nbytes / us / 1e3:>6.1f}" for us in ways.values()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
