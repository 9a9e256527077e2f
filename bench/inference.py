"""ZeRO-Inference beyond memory: `generate` of a Llama-shaped model whose weights exceed this machine's RAM.

    flock /tmp/bench.lock python -m bench.inference --results-md bench/RESULTS.md --json bench/out/inference.json
    python -m bench.inference --models small --new-tokens 4          # the in-memory comparison only

For each model (``small``: Llama shape, 1.1B parameters, fits in memory;
``big``: Llama-7B shape, 6.7B parameters, 27 GB of fp32 weights, more than
this machine's RAM):
1. ``create``: built under ``zero.Init`` with parameters on NVMe (each module's
   slices written as it is built) and saved by ``zero.save_pretrained``
   (nvmeio's streaming safetensors writer, one gathered tensor at a time);
2. ``generate`` with a contender, each in a fresh process (its own peak RSS):
   ``torch`` (plain ``from_pretrained``, the model in memory; small model only),
   ``zero-cpu`` and ``zero-nvme`` (``from_pretrained`` under ``zero.Init``, then
   ``zero.initialize`` with the Hugging Face docs' ZeRO-Inference config: no
   optimizer, parameters on that device, ``max_in_cpu`` 0), greedy, a fixed
   prompt, ``--new-tokens`` tokens. Reported: seconds per token (the whole
   ``generate`` call over the tokens made, prefill included), tokens/s, load
   time, NVMe wait, peak RSS (VmHWM) and peak anonymous memory (RssAnon sampled
   every 20 ms) of the load and of the generation separately (transformers maps
   the checkpoint: those pages count in VmHWM and are page cache the kernel
   drops under pressure), and the tokens (equal across contenders).

Needs about 2.1x the big model's bytes free under ``--nvme-dir`` (checked
first; the big checkpoint is deleted once loaded into zero.Init's swap files,
before ``zero.initialize`` writes the engine's); everything written is deleted
afterwards. A contender that fails is recorded with its error. Run it under
``flock /tmp/bench.lock``: the machine is shared.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

from bench import harness
from bench.harness import status_bytes

SECTION = "## ZeRO-Inference beyond memory (bench/inference.py)"
MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=32000),  # a smoke test of the script (--models tiny)
    "small": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000),
    "big": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000),
}
AIO = {"block_size": 8388608, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
       "overlap_events": True}


PREFETCH = 500_000_000  # elements read ahead: several layers (the docs' 0.9 * hidden^2 is less than one)
BUFFERS = 10


def ds_config(device: str, nvme_path: str, hidden: int, bf16: bool = False) -> dict:
    """The Hugging Face docs' ZeRO-Inference config, parameters on ``device`` (in bf16 with
    ``bf16``: 2 bytes per weight on NVMe), a deeper prefetch."""
    param = {"device": device, "pin_memory": False}
    if device == "nvme":
        # Each partition must fit one buffer: the embedding (vocab x hidden) is the largest.
        # 10 buffers: the units of about a layer in flight ahead of compute, besides the one computing.
        param.update(nvme_path=nvme_path, max_in_cpu=0, buffer_count=BUFFERS, buffer_size=32000 * hidden)
    return {"fp16": {"enabled": False}, "bf16": {"enabled": bf16}, "aio": AIO,
            "zero_optimization": {"stage": 3, "offload_param": param, "overlap_comm": True,
                                  "contiguous_gradients": True, "reduce_bucket_size": hidden * hidden,
                                  "stage3_prefetch_bucket_size": PREFETCH,
                                  "stage3_param_persistence_threshold": 10 * hidden},
            "steps_per_print": 2000, "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
            "wall_clock_breakdown": False}


def weight_bytes(shape: dict, contender: str) -> int:
    """Bytes of weights a token reads: 4 per parameter, 2 for a bf16 contender."""
    return n_params(shape) * (2 if contender.endswith("-bf16") else 4)


def n_params(shape: dict) -> int:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return layers * per_layer + 2 * v * h + h


# -- the child processes -------------------------------------------------------------------------

class PeakAnon:
    """Peak RssAnon, sampled every 20 ms: the memory the process holds, without the checkpoint pages
    transformers maps (file-backed, counted in VmHWM, dropped by the kernel under pressure)."""

    def __init__(self):
        import threading

        self.peak = status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, status_bytes("RssAnon"))

    def reset(self) -> None:
        self.peak = status_bytes("RssAnon")
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM starts again from the current RSS
            f.write("5")

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, status_bytes("RssAnon"))


def _vmhwm() -> int:
    return status_bytes("VmHWM")


def child_create(model: str, out_dir: str, nvme: str) -> dict:
    import torch
    import transformers

    import zero

    shape = MODELS[model]
    config = transformers.LlamaConfig(max_position_embeddings=256, tie_word_embeddings=False, **shape)
    ds = ds_config("nvme", nvme, shape["hidden_size"])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zero.Init(config_dict_or_path=ds):
        llama = transformers.LlamaForCausalLM(config)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    zero.save_pretrained(llama, out_dir)
    saved = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    return {"build_s": built, "save_s": saved, "checkpoint_bytes": nbytes, "peak_rss": _vmhwm()}


def child_generate(model: str, contender: str, ckpt: str, nvme: str, new_tokens: int, drop_ckpt: bool) -> dict:
    import torch
    import transformers

    import zero

    shape = MODELS[model]
    prompt = torch.tensor([[1, 306, 4658, 278, 6593, 310, 2834, 338]])
    anon = PeakAnon()
    t0 = time.perf_counter()
    if contender == "torch":
        llama = transformers.LlamaForCausalLM.from_pretrained(ckpt)
        engine = None
    else:
        ds = ds_config(contender.split("-")[1], nvme, shape["hidden_size"], bf16=contender.endswith("-bf16"))
        with zero.Init(config_dict_or_path=ds):
            llama = transformers.LlamaForCausalLM.from_pretrained(ckpt)
        if drop_ckpt:  # the values are in zero.Init's swap files now; the engine's need the disk space
            shutil.rmtree(ckpt)
        engine, _, _, _ = zero.initialize(model=llama, config=ds)
        engine.eval()
    load = time.perf_counter() - t0
    load_hwm, load_anon = _vmhwm(), anon.stop()
    llama.eval()
    anon = PeakAnon()
    anon.reset()
    stamps = []

    def stamp(input_ids, scores):  # called once per token, after its forward
        stamps.append(time.perf_counter())
        return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        out = llama.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, logits_processor=transformers.LogitsProcessorList([stamp]))
    gen = time.perf_counter() - t0
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:]))  # the forwards after the prompt's
    gen_hwm, gen_anon = _vmhwm(), anon.stop()
    swap_wait = engine.parts.param_store.read_wait_seconds if engine is not None else 0.0
    if engine is not None:
        engine.destroy()
    decode = steps[len(steps) // 2] if steps else gen
    return {"load_s": load, "generate_s": gen, "s_per_token": gen / new_tokens, "tokens_per_s": new_tokens / gen,
            "prefill_s": stamps[0] - t0, "decode_s_per_token": decode, "decode_tokens_per_s": 1 / decode,
            "weight_bytes": weight_bytes(shape, contender),
            "model_gib_per_s": weight_bytes(shape, contender) / decode / 2 ** 30,
            "swap_wait_s": swap_wait, "tokens": out[0, prompt.shape[1]:].tolist(), "load_peak_rss": load_hwm,
            "load_peak_anon": load_anon, "peak_rss": gen_hwm, "peak_anon": gen_anon}


def run_child(*args: str) -> dict:
    result = harness.run_child("bench.inference", ["--child", *args])
    if "error" in result:
        raise RuntimeError(f"child {args} failed:\n" + "\n".join(result["tail"]) + f"\n{result['error']}")
    return result


# -- the run ---------------------------------------------------------------------------------------

def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f}"


FIO_READ_BYTES = 2 << 30


def fio_read(work: str) -> float:
    """The disk's best read speed right now (GiB/s): fio at its best settings (io_uring, 4 MiB
    blocks, iodepth 32, huge-page memory, O_DIRECT), the fastest of three runs over a 2 GiB file
    in ``work``, page cache dropped; 0 when fio is missing. Every token reads all weights once,
    so this is the speed a generate from NVMe can approach."""
    best = harness.fio_reference(FIO_READ_BYTES, 0, work, runs=3)
    return best["read_bytes"] / best["seconds"] / 2 ** 30 if best.get("seconds") else 0.0


def check_space(path: str, models) -> None:
    need = int(2.1 * max(n_params(MODELS[m]) * 4 for m in models))
    free = shutil.disk_usage(path).free
    if free < need:
        raise SystemExit(f"{path} has {gib(free)} GiB free; this run needs {gib(need)} GiB (2.1x the largest "
                         f"model's fp32 weights: zero.Init's swap files plus the checkpoint, then the engine's)")


def of_fio(g: dict) -> str:
    disk = g.get("fio_read_gib_s", 0.0)
    return f" ({g['model_gib_per_s'] / disk:.2f}x {disk:.2f})" if disk else ""


def table(results: dict, ram: int) -> list:
    rows = ["| model | params | weights read per token | contender | load s | load peak RSS / anon GiB | prompt s | s/token "
            "| tokens/s | weights GiB/s (of fio read) | NVMe wait s | generate peak RSS / anon GiB | generate RSS / weights |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, r in results.items():
        weights = r["params"] * 4
        for name, g in r["generate"].items():
            weights = g.get("weight_bytes", r["params"] * 4)
            rows.append(f"| {model} | {r['params'] / 1e9:.2f}B | {gib(weights)} GiB"
                        f"{' (> RAM)' if weights > ram else ''} | {name} | {g['load_s']:.1f} | "
                        f"{gib(g['load_peak_rss'])} / {gib(g['load_peak_anon'])} | {g['prefill_s']:.2f} | "
                        f"{g['decode_s_per_token']:.2f} | {g['decode_tokens_per_s']:.3f} | "
                        f"{g['model_gib_per_s']:.2f}{of_fio(g)} | {g['swap_wait_s']:.1f} | {gib(g['peak_rss'])} / "
                        f"{gib(g['peak_anon'])} | {g['peak_rss'] / weights:.2f} |")
        weights = r["params"] * 4
        for name, why in r.get("failed", {}).items():
            rows.append(f"| {model} | {r['params'] / 1e9:.2f}B | {gib(weights)} GiB | {name} | failed: {why} |"
                        " | | | | | | | |")
    return rows


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    labels, tps, rss = [], [], []
    for model, r in results.items():
        for name, g in r["generate"].items():
            labels.append(f"{model}\n{name}")
            tps.append(g["decode_tokens_per_s"])
            rss.append(g["peak_rss"] / 2 ** 30)
    a.bar(labels, tps, color="tab:blue")
    a.set_ylabel("tokens / s")
    a.set_title("greedy generate, batch 1 (after the prompt)")
    b.bar(labels, rss, color="tab:orange")
    b.set_ylabel("peak RSS (GiB)")
    b.axhline(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, color="k", ls="--", lw=1)
    b.set_title("peak RSS (dashed: RAM)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_section(record: dict, results_md: str) -> None:
    """The RESULTS.md section (table, notes, chart) of one run's record."""
    rows = table(record["results"], record["ram_bytes"])
    png = os.path.join(os.path.dirname(os.path.abspath(results_md)), "inference.png")
    chart(record["results"], png)
    same = all(len({tuple(g["tokens"]) for n, g in r["generate"].items() if not n.endswith("-bf16")}) <= 1
               for r in record["results"].values())
    body = [f"Run {record['started']}, commit {record.get('commit', '?')}, load average {record['load_start']} at the start, {record['load_end']} at the end "
            f"(2 CPUs, {gib(record['ram_bytes'])} GiB RAM, one virtio disk: ~3.4 GiB/s read). Greedy `generate` of "
            f"{record['new_tokens']} tokens from an 8-token prompt, batch 1, fp32; each contender a fresh process "
            f"(peak RSS = its VmHWM). Models built under `zero.Init` with parameters on NVMe and saved by "
            f"`zero.save_pretrained` (nvmeio's streaming safetensors writer); the zero contenders load them "
            f"with `from_pretrained` under `zero.Init` and the Hugging Face docs' ZeRO-Inference config "
            f"(no optimizer; for NVMe `max_in_cpu` 0, `buffer_count` {BUFFERS}, `stage3_prefetch_bucket_size` "
            f"{PREFETCH:.0e} instead of the docs' 0.9·hidden², which is less than one layer). prompt s: the "
            f"first `generate` step (the prompt's forward, which also records the fetch trace); s/token: the "
            f"median of the later steps (one token each); weights GiB/s: fp32 weight bytes / s/token (every "
            f"token reads all weights once), and in brackets its ratio to fio's read speed measured just before "
            f"that contender (fio at its best: io_uring, 4 MiB blocks, iodepth 32, huge-page memory, the fastest "
            f"of three runs over a 2 GiB file, page cache dropped).", "", *rows, "",
            f"Tokens equal across contenders of a model: {'yes' if same else 'NO'}.", "",
            "![ZeRO-Inference](inference.png)"]
    for model, r in record["results"].items():
        c = r["create"]
        body.insert(-2, f"- {model}: built under zero.Init in {c['build_s']:.0f} s at peak RSS "
                        f"{gib(c['peak_rss'])} GiB, saved ({gib(c['checkpoint_bytes'])} GiB) in {c['save_s']:.0f} s.")
    body.insert(-2 - len(record["results"]), "")
    body[-2:-2] = record.get("notes", [])
    harness.write_section(results_md, SECTION, figures(record), record.get("command", "python -m bench.inference"),
                          "\n".join(body))


def figures(record: dict) -> list:
    """The headline: the weight bytes a token reads per second from NVMe against fio's read
    (issue 21: 0.9x for fp32 weights), and the peak RSS against the weights."""
    out, when = [], record["started"]
    for model, r in record["results"].items():
        for name, g in r["generate"].items():
            disk = g.get("fio_read_gib_s", 0.0)
            if name.startswith("zero-nvme") and disk:
                ratio = g["model_gib_per_s"] / disk
                fp32 = name == "zero-nvme"
                out.append(harness.Figure(f"{model} ({r['params'] / 1e9:.2f}B), {name}: weights read per s / fio's "
                                          f"read ({g['decode_s_per_token']:.2f} s/token)", f"**{ratio:.2f}x**",
                                          "≥ 0.9x (issue 21)" if fp32 else "—", ratio >= 0.9 if fp32 else None, when))
            if name.startswith("zero-nvme"):
                share = g["peak_rss"] / g.get("weight_bytes", r["params"] * 4)
                out.append(harness.Figure(f"{model}, {name}: generate peak RSS / weights", f"{share:.2f}", when=when))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", nargs="+")
    p.add_argument("--models", nargs="+", default=["small", "big"], choices=list(MODELS))
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--contenders", nargs="+", choices=["torch", "zero-cpu", "zero-nvme", "zero-nvme-bf16"],
                   help="default: all four for the small model, zero-nvme for the big one")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--json")
    p.add_argument("--results-md")
    p.add_argument("--render", metavar="JSON", help="only rewrite --results-md's section from a run's --json")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            write_section(json.load(f), args.results_md)
        return 0
    if args.child:
        kind, *rest = args.child
        if kind == "create":
            result = child_create(rest[0], rest[1], rest[2])
        else:
            result = child_generate(rest[0], rest[1], rest[2], rest[3], int(rest[4]), rest[5] == "1")
        harness.print_result(result)
        return 0

    check_space(args.nvme_dir, args.models)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_start = harness.load_average()
    results = {}
    work = tempfile.mkdtemp(prefix="bench-inference-", dir=args.nvme_dir)
    try:
        for model in args.models:
            ckpt, swap = os.path.join(work, f"{model}-ckpt"), os.path.join(work, "swap")
            os.makedirs(swap, exist_ok=True)
            created = run_child("create", model, ckpt, swap)
            print(f"{model}: built in {created['build_s']:.1f} s, saved in {created['save_s']:.1f} s "
                  f"({gib(created['checkpoint_bytes'])} GiB), peak RSS {gib(created['peak_rss'])} GiB", flush=True)
            contenders = args.contenders or (["zero-nvme"] if model == "big" else
                                             ["torch", "zero-cpu", "zero-nvme", "zero-nvme-bf16"])
            gens, failed = {}, {}
            for name in contenders:
                last = name == contenders[-1]
                try:
                    disk = fio_read(work) if name.startswith("zero-nvme") else 0.0
                    gens[name] = run_child("generate", model, name, ckpt, swap, str(args.new_tokens),
                                           "1" if last and model == "big" else "0")
                    gens[name]["fio_read_gib_s"] = disk
                except RuntimeError as exc:  # recorded in the results, not hidden
                    failed[name] = str(exc).strip().splitlines()[-1]
                    print(f"  {name}: FAILED: {failed[name]}", flush=True)
                    continue
                g = gens[name]
                print(f"  {name}: load {g['load_s']:.1f} s (peak RSS {gib(g['load_peak_rss'])}, anon "
                      f"{gib(g['load_peak_anon'])} GiB), prompt {g['prefill_s']:.2f} s, {g['decode_s_per_token']:.2f} s/token "
                      f"({g['model_gib_per_s']:.2f} GiB/s of weights{of_fio(g)}), NVMe wait {g['swap_wait_s']:.1f} s, generate peak RSS "
                      f"{gib(g['peak_rss'])} GiB (anon {gib(g['peak_anon'])}), tokens {g['tokens']}", flush=True)
            results[model] = {"params": n_params(MODELS[model]), "shape": MODELS[model], "create": created,
                              "generate": gens, "failed": failed}
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = harness.load_average()
    rows = table(results, ram)
    print("\n".join(rows))
    record = {"started": started, "load_start": load_start, "load_end": load_end, "ram_bytes": ram,
              "new_tokens": args.new_tokens, "results": results, "commit": harness.commit(),
              "command": "python -m bench.inference " + " ".join(sys.argv[1:] if argv is None else argv)}
    harness.save_json(record, args.json, indent=1)
    if args.results_md:
        write_section(record, args.results_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
