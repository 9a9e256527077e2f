"""bench/inference.py's report: the tables, the chart, the headline and the RESULTS.md section of
one run's record (``python -m bench.inference --render JSON --results-md ...`` redraws them)."""
from __future__ import annotations

import os

from bench import harness

SECTION = "## ZeRO-Inference beyond memory (bench/inference.py)"
BATCH_GOAL = 20  # issue 32: decode tokens/s at batch 32 >= 20x batch 1 while I/O-bound
FIO_GOAL = 0.9  # issue 32: weights read per decode forward at >= 0.9x fio's best read, every batch


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


def decode_read(x: dict, counter: str = "disk"):
    """Bytes a decode forward of batch run ``x`` read: the mean of its decode forwards by ``counter``
    ("disk": /proc/self/io; "swap": the parameter swapper's, None where there is none). How much of
    the next forward a forward reads ahead depends on timing; what they read together does not."""
    per_forward = x[f"{counter}_read_per_forward"]
    if per_forward is None:
        return None
    decode = per_forward[1:] or per_forward
    return sum(decode) / len(decode)


def of_fio(g: dict, r: dict) -> str:
    disk = g.get("fio_read_gib_s", 0.0)
    return f" ({r['model_gib_per_s'] / disk:.2f}x {disk:.2f})" if disk else ""


def load_table(results: dict, ram: int) -> list:
    rows = ["| model | params | weights read per forward | contender | load s | load peak RSS / anon GiB | NVMe wait s "
            "(all batches) |", "|---|---|---|---|---:|---|---:|"]
    for model, r in results.items():
        for name, g in r["generate"].items():
            w = g["weight_bytes"]
            rows.append(f"| {model} | {r['params'] / 1e9:.2f}B | {gib(w)} GiB{' (> RAM)' if w > ram else ''} | {name} | "
                        f"{g['load_s']:.1f} | {gib(g['load_peak_rss'])} / {gib(g['load_peak_anon'])} | "
                        f"{g['swap_wait_s']:.1f} |")
        for name, why in r.get("failed", {}).items():
            rows.append(f"| {model} | {r['params'] / 1e9:.2f}B | | {name} | failed: {why} | | |")
    return rows


def batch_table(results: dict) -> list:
    rows = ["| model | contender | batch | prompt s | decode s / step | decode tokens/s | tokens/s, whole call | "
            "read per decode forward GiB: swapper / /proc/self/io | weights GiB/s (of fio read) | "
            "generate peak RSS / anon GiB |", "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for model, r in results.items():
        for name, g in r["generate"].items():
            for b, x in g["batches"].items():
                swap = decode_read(x, "swap")
                swap = gib(swap) if swap is not None else "—"
                rows.append(f"| {model} | {name} | {b} | {x['prefill_s']:.2f} | {x['decode_s_per_step']:.2f} | "
                            f"{x['decode_tokens_per_s']:.2f} | {x['tokens_per_s']:.2f} | {swap} / "
                            f"{gib(decode_read(x))} | {x['model_gib_per_s']:.2f}{of_fio(g, x)} | "
                            f"{gib(x['peak_rss'])} / {gib(x['peak_anon'])} |")
    return rows


def same_tokens(results: dict) -> dict:
    """Per model and batch: whether every fp32 contender made the same tokens."""
    out = {}
    for model, r in results.items():
        by_batch = {}
        for name, g in r["generate"].items():
            if not name.endswith("-bf16"):
                for b, x in g["batches"].items():
                    by_batch.setdefault(b, set()).add(str(x["tokens"]))
        out[model] = {b: len(s) == 1 for b, s in by_batch.items()}
    return out


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for model, r in results.items():
        for name, g in r["generate"].items():
            batches = [int(k) for k in g["batches"]]
            runs = list(g["batches"].values())
            a.plot(batches, [x["decode_tokens_per_s"] for x in runs], "o-", label=f"{model} {name}: decode")
            a.plot(batches, [x["tokens_per_s"] for x in runs], "x--", label=f"{model} {name}: whole call")
            b.plot(batches, [x["model_gib_per_s"] for x in runs], "o-", label=f"{model} {name}")
            disk = g.get("fio_read_gib_s", 0.0)
            if disk and name == "zero-nvme":
                b.axhline(disk, color="k", ls="--", lw=1, label=f"fio read ({disk:.2f})")
                b.axhline(FIO_GOAL * disk, color="k", ls=":", lw=1, label=f"{FIO_GOAL} x fio")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("batch")
    a.set_ylabel("tokens / s")
    a.set_title("greedy generate by batch")
    b.set_xscale("log", base=2)
    b.set_xlabel("batch")
    b.set_ylabel("weight GiB / decode step")
    b.set_title("weights read per s of a decode step")
    for ax in (a, b):
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def figures(record: dict) -> list:
    """The headline: decode tokens/s at the largest batch against batch 1 (with the bytes each forward
    reads at both), each batch's weight bytes per s against fio's read, ours against DeepSpeed's."""
    out, when = [], record["started"]
    for model, r in record["results"].items():
        g = r["generate"].get("zero-nvme")
        if g is None:
            continue
        runs, disk = g["batches"], g.get("fio_read_gib_s", 0.0)
        first, last = runs.get("1"), runs[max(runs, key=int)]
        if first is not None and last is not first:
            ratio = last["decode_tokens_per_s"] / first["decode_tokens_per_s"]
            same = decode_read(last) / decode_read(first)
            out.append(harness.Figure(
                f"{model} ({r['params'] / 1e9:.2f}B), zero-nvme: decode tokens/s, batch {last['batch']} / batch 1 "
                f"(bytes read per forward {last['batch']} / 1: {same:.3f})", f"**{ratio:.1f}x**",
                f"≥ {BATCH_GOAL}x (issue 32)", ratio >= BATCH_GOAL and abs(same - 1) < 0.01, when))
            whole = last["tokens_per_s"] / first["tokens_per_s"]
            out.append(harness.Figure(f"{model}, zero-nvme: tokens/s of the whole call (prompt included), batch "
                                      f"{last['batch']} / batch 1", f"{whole:.1f}x", when=when))
        for b, x in runs.items():
            if disk:
                ratio = x["model_gib_per_s"] / disk
                out.append(harness.Figure(f"{model}, zero-nvme, batch {b}: weights read per s of a decode step / "
                                          f"fio's read ({x['decode_s_per_step']:.2f} s/step)", f"**{ratio:.2f}x**",
                                          f"≥ {FIO_GOAL}x (issue 32)", ratio >= FIO_GOAL, when))
        ds = r["generate"].get("ds-nvme")
        for b, x in runs.items():
            if ds is not None and b in ds["batches"]:
                ratio = x["decode_tokens_per_s"] / ds["batches"][b]["decode_tokens_per_s"]
                out.append(harness.Figure(f"{model}, batch {b}: decode tokens/s, zero-nvme / DeepSpeed's ZeRO-Inference",
                                          f"**{ratio:.2f}x**", "≥ 1x (issue 32)", ratio >= 1, when))
        if "ds-nvme" in r.get("failed", {}):
            out.append(harness.Figure(f"{model}: DeepSpeed's ZeRO-Inference (ds-nvme)", "failed",
                                      "≥ 1x where it runs (issue 32)", None, when))
        peak = max(x["peak_rss"] for x in runs.values())
        out.append(harness.Figure(f"{model}, zero-nvme: generate peak RSS / weights (all batches)",
                                  f"{peak / g['weight_bytes']:.2f}", when=when))
    return out


def write_section(record: dict, results_md: str) -> None:
    """The RESULTS.md section (headline, tables, notes, chart) of one run's record."""
    s = record["settings"]
    png = os.path.join(os.path.dirname(os.path.abspath(results_md)), "inference.png")
    chart(record["results"], png)
    same = same_tokens(record["results"])
    body = [f"Run {record['started']}, commit {record.get('commit', '?')}, load average {record['load_start']} at the "
            f"start, {record['load_end']} at the end (2 CPUs, {gib(record['ram_bytes'])} GiB RAM, one virtio disk). "
            f"FlexGen's convention scaled to this CPU: every row a {s['prompt_len']}-token prompt (random tokens, no "
            f"padding), {s['new_tokens']} new tokens, greedy, fp32, batches {', '.join(map(str, s['batches']))}; "
            f"each contender a fresh process that loads once, runs one 2-token `generate` (it records the fetch "
            f"trace), then one `generate` per batch. Models built under `zero.Init` with parameters on NVMe and saved "
            f"by `zero.save_pretrained`; the zero contenders load them with `from_pretrained` under `zero.Init` and "
            f"the Hugging Face docs' ZeRO-Inference config (no optimizer; for NVMe `max_in_cpu` 0, `buffer_count` "
            f"{s['buffer_count']}, `stage3_prefetch_bucket_size` {s['prefetch']:.0e} instead of the docs' "
            f"0.9·hidden², which is less than one layer); ds-nvme: DeepSpeed {s.get('deepspeed', '0.19.8')} with the "
            f"same config through `HfDeepSpeedConfig` and `deepspeed.initialize`. prompt s: the first forward (all "
            f"rows' prompts); decode s / step: the median of the later forwards (one token for every row); decode "
            f"tokens/s: batch / that; tokens/s, whole call: the tokens made / the `generate` call's seconds; read per "
            f"decode forward: the decode forwards' mean bytes by the parameter swapper's counter and by "
            f"`/proc/self/io` (read_bytes: O_DIRECT reads included, DeepSpeed's too); weights GiB/s: the weight "
            f"bytes / decode s per step (every forward reads every weight once), in brackets its ratio to fio's read "
            f"measured just before that contender (fio at its best: io_uring, 4 MiB blocks, iodepth 32, huge-page "
            f"memory, the fastest of three runs over a 2 GiB file, page cache dropped).", "",
            *batch_table(record["results"]), "", *load_table(record["results"], record["ram_bytes"]), "",
            "Tokens equal across fp32 contenders, by model and batch: " + "; ".join(
                f"{m} " + ", ".join(f"{b}: {'yes' if ok else 'NO'}" for b, ok in by.items()) for m, by in same.items())
            + ".", ""]
    for model, r in record["results"].items():
        c = r["create"]
        body.append(f"- {model}: built under zero.Init in {c['build_s']:.0f} s at peak RSS {gib(c['peak_rss'])} GiB, "
                    f"saved ({gib(c['checkpoint_bytes'])} GiB) in {c['save_s']:.0f} s.")
    body += [*record.get("notes", []), "", "![ZeRO-Inference](inference.png)"]
    harness.write_section(results_md, SECTION, figures(record), record.get("command", "python -m bench.inference"),
                          "\n".join(body))
