#!/usr/bin/env python3
"""Plots a side-by-side run against upstream: bandwidth by value size, per mode, ours
next to upstream, as SVG (no plotting library needed).

The input is what the upstream harness's `compare_upstream.py` prints (its table of
medians); the figures are kept as JSON next to the plots, and the plots can be drawn
again from that JSON alone:

    compare_upstream.py --modes dummy,emb_local,emb_remote > run.txt
    benches/plot_compare.py --table run.txt --out docs/perf/2026-12-06
    benches/plot_compare.py --json docs/perf/2026-12-06.json --out docs/perf/2026-12-06

writes `<out>.json` (with --table), `<out>-<mode>.svg` for each mode in the run and
`<out>.md`, one Markdown table per mode (what docs/performance.md shows).
"""

import argparse
import json
import math
import re
import sys

CASES = ["get_into", "put_from", "get", "put", "batch_get_into", "batch_put_from"]
ROW = re.compile(
    r"^(?:(?P<mode>\w+):)?(?P<case>[\w()]+) (?P<size>\d+)K\s+"
    r"(?P<up>[\d.]+)\s+(?P<ours>[\d.]+)\s+\S+\s+(?P<up_us>[\d.]+)\s+(?P<ours_us>[\d.]+)"
)
MEMCPY = re.compile(r"memcpy 64MiB GB/s: during upstream ([\d.]+), during ours ([\d.]+)")


def parse_table(text):
    """The rows and memcpy figures of a compare_upstream.py output."""
    rows = []
    for line in text.splitlines():
        match = ROW.match(line.strip())
        if not match:
            continue
        rows.append(
            {
                "mode": match["mode"] or "dummy",
                "case": match["case"],
                "size_kib": int(match["size"]),
                "up_gbps": float(match["up"]),
                "ours_gbps": float(match["ours"]),
                "up_p50_us": float(match["up_us"]),
                "ours_p50_us": float(match["ours_us"]),
            }
        )
    memcpy = MEMCPY.search(text)
    if not rows:
        raise SystemExit("no rows found: is this compare_upstream.py's output?")
    return {
        "memcpy_gbps": {"during_upstream": float(memcpy[1]), "during_ours": float(memcpy[2])}
        if memcpy
        else None,
        "rows": rows,
    }


def size_label(kib):
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def svg_for(mode, rows, memcpy):
    """One grouped bar chart (log scale, GB/s) of `mode`'s bandwidth rows."""
    picked = [r for r in rows if r["mode"] == mode and r["case"] in CASES and r["ours_gbps"] > 0]
    picked.sort(key=lambda r: (CASES.index(r["case"]), r["size_kib"]))
    if not picked:
        return None
    width, height, left, bottom, top = 60 + 46 * len(picked), 360, 60, 90, 40
    plot_h = height - bottom - top
    values = [v for r in picked for v in (r["up_gbps"], r["ours_gbps"]) if v > 0]
    low = 10 ** math.floor(math.log10(min(values)))
    high = 10 ** math.ceil(math.log10(max(values + [memcpy or 0])))

    def y(value):
        frac = (math.log10(max(value, low)) - math.log10(low)) / (
            math.log10(high) - math.log10(low)
        )
        return top + plot_h * (1 - frac)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="14">{mode}: GB/s by value size '
        "(log scale; median of the run)</text>",
        f'<rect x="{width - 210}" y="8" width="10" height="10" fill="#9e9e9e"/>'
        f'<text x="{width - 196}" y="17">upstream</text>'
        f'<rect x="{width - 136}" y="8" width="10" height="10" fill="#1f77b4"/>'
        f'<text x="{width - 122}" y="17">mooncake-rs</text>',
    ]
    decade = low
    while decade <= high * 1.0001:
        out.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y(decade):.1f}" y2="{y(decade):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y(decade) + 4:.1f}" text-anchor="end">{decade:g}</text>'
        )
        decade *= 10
    if memcpy:
        out.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y(memcpy):.1f}" y2="{y(memcpy):.1f}" '
            'stroke="#d62728" stroke-dasharray="4 3"/>'
            f'<text x="{width - 12}" y="{y(memcpy) - 4:.1f}" text-anchor="end" '
            f'fill="#d62728">memcpy {memcpy:.1f}</text>'
        )
    for index, row in enumerate(picked):
        x = left + 10 + 46 * index
        for offset, value, color in ((0, row["up_gbps"], "#9e9e9e"), (18, row["ours_gbps"], "#1f77b4")):
            if value <= 0:
                continue
            out.append(
                f'<rect x="{x + offset}" y="{y(value):.1f}" width="16" '
                f'height="{top + plot_h - y(value):.1f}" fill="{color}">'
                f"<title>{row['case']} {size_label(row['size_kib'])}: {value:.3f} GB/s</title></rect>"
            )
        label = f"{row['case']} {size_label(row['size_kib'])}"
        out.append(
            f'<text transform="translate({x + 20},{top + plot_h + 8}) rotate(50)">{label}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def markdown(figures):
    """One table per mode: every case and size, upstream and ours, and the ratios."""
    memcpy = figures.get("memcpy_gbps") or {}
    lines = []
    if memcpy:
        lines.append(
            f"memcpy of 64 MiB in the same run: {memcpy['during_upstream']:.1f} GB/s while "
            f"upstream ran, {memcpy['during_ours']:.1f} GB/s while ours ran.\n"
        )
    order = ["dummy", "emb_local", "emb_remote"]
    for mode in sorted({r["mode"] for r in figures["rows"]}, key=order.index):
        lines.append(f"**{mode}**\n")
        lines.append("| case | size | upstream GB/s | ours GB/s | × | upstream p50 µs | ours p50 µs | p50 × |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
        rows = [r for r in figures["rows"] if r["mode"] == mode]
        for r in sorted(rows, key=lambda r: (r["case"], r["size_kib"])):
            size = size_label(r["size_kib"]) if r["size_kib"] else "—"
            bw = (
                (f"{r['up_gbps']:.3f}", f"{r['ours_gbps']:.3f}", f"{r['ours_gbps'] / r['up_gbps']:.2f}")
                if r["up_gbps"] > 0
                else ("—", "—", "—")
            )
            lat = r["ours_p50_us"] / r["up_p50_us"] if r["up_p50_us"] else float("nan")
            lines.append(
                f"| `{r['case']}` | {size} | {bw[0]} | {bw[1]} | {bw[2]} | "
                f"{r['up_p50_us']:.1f} | {r['ours_p50_us']:.1f} | {lat:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--table", help="compare_upstream.py's output")
    source.add_argument("--json", help="figures kept by an earlier --table run")
    parser.add_argument("--out", required=True, help="path prefix of what is written")
    args = parser.parse_args()
    if args.table:
        figures = parse_table(open(args.table).read())
        with open(args.out + ".json", "w") as out:
            json.dump(figures, out, indent=1)
            out.write("\n")
    else:
        figures = json.load(open(args.json))
    with open(args.out + ".md", "w") as out:
        out.write(markdown(figures))
    memcpy = (figures.get("memcpy_gbps") or {}).get("during_ours")
    modes = sorted({r["mode"] for r in figures["rows"]}, key=["dummy", "emb_local", "emb_remote"].index)
    for mode in modes:
        svg = svg_for(mode, figures["rows"], memcpy)
        if svg:
            with open(f"{args.out}-{mode}.svg", "w") as out:
                out.write(svg)
            print(f"{args.out}-{mode}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
