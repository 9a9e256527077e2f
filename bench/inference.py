"""ZeRO-Inference beyond memory: `generate` of a Llama-shaped model whose weights exceed this machine's RAM,
at batch 1, 8 and 32.

    flock /tmp/bench.lock python -m bench.inference --models small --results-md bench/RESULTS.md --json bench/out/inference.json
    python -m bench.inference --models tiny --batches 1 2 --contenders zero-nvme   # a smoke test

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
   optimizer, parameters on that device, ``max_in_cpu`` 0), ``ds-nvme``
   (DeepSpeed 0.19.8's ZeRO-Inference, the same config through its
   ``HfDeepSpeedConfig`` and ``deepspeed.initialize``, in DeepSpeed's venv).
   Each loads once, runs one short ``generate`` that records the fetch trace,
   then one greedy ``generate`` per ``--batches`` size: FlexGen's convention
   (every row a ``--prompt-len``-token prompt, ``--new-tokens`` tokens made)
   scaled down to this CPU. Reported per batch: the prompt's forward (prefill),
   the median later forward (one token per row: the decode step), tokens/s of
   the decode (rows / step) and of the whole call (tokens made / its seconds),
   the bytes each forward reads (the parameter swapper's counter, and
   ``/proc/self/io``'s read_bytes, the only one DeepSpeed has), their GiB/s
   against fio's best read measured just before the contender, peak RSS (VmHWM)
   and peak anonymous memory (RssAnon sampled every 20 ms) of the load and of
   each batch's generation (transformers maps the checkpoint: those pages count
   in VmHWM and are page cache the kernel drops under pressure), and the tokens
   (equal across contenders of a model and batch in fp32).

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

from bench import harness, training
from bench.harness import status_bytes
from bench.inference_report import batch_table, decode_read, gib, write_section

MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=32000),  # a smoke test of the script (--models tiny)
    "small": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000),
    "big": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000),
    # bench/gpu_check.py's infer stage: 426M parameters, 1.59 GiB of fp32 weights, more than the 1.22 GiB of
    # swap buffers (BUFFERS x 32000 x hidden), so that every forward reads its swapped weights again (1.28 GiB:
    # the attention matrices, under min_swap_bytes, stay in host memory)
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=32, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000),
}
AIO = {"block_size": 8388608, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
       "overlap_events": True}


CONTENDERS = ("torch", "zero-cpu", "zero-nvme", "zero-nvme-bf16", "ds-nvme")
DS_HF_PATH = "/opt/dsvenv-hf"  # transformers for DeepSpeed's venv, beside it (the venv itself is left as it is)
DS_VENV_HOWTO = ("python -m venv /opt/dsvenv && /opt/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8 ninja "
                 "&& apt-get install -y libaio-dev && /opt/dsvenv/bin/pip install --no-deps --target /opt/dsvenv-hf "
                 "transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 pyyaml regex "
                 "tqdm typer click rich shellingham hf-xet httpx2 httpcore2 anyio idna h11 truststore")
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


def load(contender: str, ckpt: str, nvme: str, shape: dict, drop_ckpt: bool):
    """The model of ``contender`` loaded from ``ckpt``: (model, what keeps it alive, a callable giving
    the bytes its parameter swapper has read so far or None, a callable giving its NVMe wait s)."""
    import transformers

    if contender == "torch":
        return transformers.LlamaForCausalLM.from_pretrained(ckpt), None, None, lambda: 0.0
    device = contender.split("-")[1]
    ds = ds_config(device, nvme, shape["hidden_size"], bf16=contender.endswith("-bf16"))
    if contender.startswith("ds-"):  # DeepSpeed's ZeRO-Inference as the Hugging Face docs run it
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        training.join_as_single_rank()
        keep = HfDeepSpeedConfig(ds)  # from_pretrained builds under deepspeed.zero.Init while it lives
        llama = transformers.LlamaForCausalLM.from_pretrained(ckpt)
        engine = deepspeed.initialize(model=llama, config_params=ds)[0]
        engine.module.eval()
        return llama, (keep, engine), None, lambda: 0.0
    import zero

    with zero.Init(config_dict_or_path=ds):
        llama = transformers.LlamaForCausalLM.from_pretrained(ckpt)
    if drop_ckpt:  # the values are in zero.Init's swap files now; the engine's need the disk space
        shutil.rmtree(ckpt)
    engine, _, _, _ = zero.initialize(model=llama, config=ds)
    engine.eval()
    store = engine.parts.param_store
    swapped = (lambda: store.swapper.io_bytes.read) if device == "nvme" else None
    return llama, engine, swapped, lambda: store.read_wait_seconds if device == "nvme" else 0.0


def generate_batch(llama, batch: int, prompt_len: int, new_tokens: int, swapped, device="cpu") -> dict:
    """One greedy ``generate`` of ``new_tokens`` tokens for ``batch`` prompts of ``prompt_len`` random
    tokens on ``device`` (where the model computes): the seconds and bytes of each forward (a logits
    processor marks the end of each)."""
    import torch
    import transformers

    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(3, 32000, (batch, prompt_len), generator=g).to(device)
    marks = []  # (seconds, swapper bytes, /proc/self/io bytes) at the start and after each forward

    def mark():
        marks.append((time.perf_counter(), swapped() if swapped else 0, harness.proc_io()["read_bytes"]))

    def stamp(input_ids, scores):
        mark()
        return scores

    anon = PeakAnon()
    anon.reset()
    mark()
    with torch.no_grad():
        out = llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=transformers.LogitsProcessorList([stamp]))
    gen = time.perf_counter() - marks[0][0]
    hwm, peak_anon = _vmhwm(), anon.stop()
    steps = [tuple(b - a for a, b in zip(x, y)) for x, y in zip(marks, marks[1:])]
    decode = steps[1:] or steps  # the forwards after the prompt's
    median = sorted(s[0] for s in decode)[len(decode) // 2]
    return {"batch": batch, "generate_s": gen, "prefill_s": steps[0][0], "decode_s_per_step": median,
            "decode_tokens_per_s": batch / median, "tokens_per_s": batch * new_tokens / gen,
            "swap_read_per_forward": [s[1] for s in steps] if swapped else None,
            "disk_read_per_forward": [s[2] for s in steps], "peak_rss": hwm, "peak_anon": peak_anon,
            "tokens": out[:, prompt_len:].tolist()}


def child_generate(model: str, contender: str, ckpt: str, nvme: str, batches: list, prompt_len: int,
                   new_tokens: int, drop_ckpt: bool) -> dict:
    shape = MODELS[model]
    anon = PeakAnon()
    t0 = time.perf_counter()
    llama, keep, swapped, wait = load(contender, ckpt, nvme, shape, drop_ckpt)
    load_s = time.perf_counter() - t0
    load_hwm, load_anon = _vmhwm(), anon.stop()
    llama.eval()
    device = getattr(keep, "device", "cpu")  # an engine's (on a GPU machine the GPU), else the CPU
    weights = weight_bytes(shape, contender)
    warm = generate_batch(llama, 1, 8, 2, swapped, device)  # records the fetch trace: every batch below follows it
    runs = {}
    for batch in batches:
        r = generate_batch(llama, batch, prompt_len, new_tokens, swapped, device)
        r["model_gib_per_s"] = weights / r["decode_s_per_step"] / 2 ** 30
        runs[str(batch)] = r
        print(f"    batch {batch}: prompt {r['prefill_s']:.2f} s, decode {r['decode_s_per_step']:.2f} s/step "
              f"({r['decode_tokens_per_s']:.2f} tokens/s), {r['tokens_per_s']:.2f} tokens/s in all, "
              f"{gib(decode_read(r))} GiB read per decode forward", file=sys.stderr, flush=True)
    swap_wait = wait()
    if hasattr(keep, "destroy"):  # our engine: its swap files go now
        keep.destroy()
    return {"load_s": load_s, "load_peak_rss": load_hwm, "load_peak_anon": load_anon, "weight_bytes": weights,
            "swap_wait_s": swap_wait, "warmup_s": warm["generate_s"], "device": str(device), "batches": runs}


def run_child(*args: str, python=None) -> dict:
    path = os.pathsep.join([harness.ROOT, DS_HF_PATH]) if python else harness.ROOT
    result = harness.run_child("bench.inference", ["--child", *args], python=python, first_on_path=path)
    if "error" in result:
        raise RuntimeError(f"child {args} failed:\n" + "\n".join(result["tail"]) + f"\n{result['error']}")
    return result


# -- the run ---------------------------------------------------------------------------------------

FIO_READ_BYTES = 2 << 30


def fio_read(work: str) -> float:
    """The disk's best read speed right now (GiB/s): fio at its best settings (io_uring, 4 MiB
    blocks, iodepth 32, huge-page memory, O_DIRECT), the fastest of three runs over a 2 GiB file
    in ``work``, page cache dropped; 0 when fio is missing. Every forward reads all weights once,
    so this is the speed a generate from NVMe can approach."""
    best = harness.fio_reference(FIO_READ_BYTES, 0, work, runs=3)
    return best["read_bytes"] / best["seconds"] / 2 ** 30 if best.get("seconds") else 0.0


def check_space(path: str, models) -> None:
    need = int(2.1 * max(n_params(MODELS[m]) * 4 for m in models))
    free = shutil.disk_usage(path).free
    if free < need:
        raise SystemExit(f"{path} has {gib(free)} GiB free; this run needs {gib(need)} GiB (2.1x the largest "
                         f"model's fp32 weights: zero.Init's swap files plus the checkpoint, then the engine's)")


def generate(model: str, name: str, ckpt: str, swap: str, args, drop: bool) -> dict:
    """One contender's child, after fio's read on the same disk (NVMe contenders)."""
    disk = fio_read(os.path.dirname(swap)) if "nvme" in name else 0.0
    python = None
    if name.startswith("ds-"):
        missing = [p for p in (args.ds_python, DS_HF_PATH) if not os.path.exists(p)]
        if missing:
            raise RuntimeError(f"no {' or '.join(missing)}: create them with: {DS_VENV_HOWTO}")
        python = args.ds_python
    try:
        g = run_child("generate", model, name, ckpt, swap, ",".join(map(str, args.batches)), str(args.prompt_len),
                      str(args.new_tokens), "1" if drop else "0", python=python)
    finally:  # what a contender left (DeepSpeed's swap files stay after it exits)
        shutil.rmtree(swap, ignore_errors=True)
        os.makedirs(swap)
    g["fio_read_gib_s"] = disk
    return g


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", nargs="+")
    p.add_argument("--models", nargs="+", default=["small", "big"], choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of every row's prompt (FlexGen: 512)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens made for every row (FlexGen: 32)")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS,
                   help="default: torch, zero-nvme and ds-nvme for the small model, zero-nvme for the big one")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir())
    p.add_argument("--ds-python", default="/opt/dsvenv/bin/python", help="python of a venv with deepspeed==0.19.8")
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
            result = child_generate(rest[0], rest[1], rest[2], rest[3], [int(b) for b in rest[4].split(",")],
                                    int(rest[5]), int(rest[6]), rest[7] == "1")
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
            contenders = args.contenders or (["zero-nvme"] if model == "big" else ["torch", "zero-nvme", "ds-nvme"])
            gens, failed = {}, {}
            for name in contenders:
                try:
                    gens[name] = generate(model, name, ckpt, swap, args, name == contenders[-1] and model == "big")
                except RuntimeError as exc:  # recorded in the results, not hidden
                    failed[name] = str(exc).strip().splitlines()[-1][:300]
                    print(f"  {name}: FAILED: {failed[name]}", flush=True)
                    continue
                g = gens[name]
                print(f"  {name}: load {g['load_s']:.1f} s (peak RSS {gib(g['load_peak_rss'])}, anon "
                      f"{gib(g['load_peak_anon'])} GiB), fio read {g['fio_read_gib_s']:.2f} GiB/s", flush=True)
                for b, x in g["batches"].items():
                    print(f"    batch {b}: prompt {x['prefill_s']:.2f} s, decode {x['decode_s_per_step']:.2f} s/step "
                          f"= {x['decode_tokens_per_s']:.2f} tokens/s ({x['model_gib_per_s']:.2f} GiB/s of weights), "
                          f"whole call {x['tokens_per_s']:.2f} tokens/s, read per decode forward "
                          f"{gib(decode_read(x))} GiB, peak RSS {gib(x['peak_rss'])} GiB", flush=True)
            results[model] = {"params": n_params(MODELS[model]), "shape": MODELS[model], "create": created,
                              "generate": gens, "failed": failed}
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"started": started, "load_start": load_start, "load_end": harness.load_average(), "ram_bytes": ram,
              "settings": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batches": args.batches,
                           "buffer_count": BUFFERS, "prefetch": PREFETCH, "deepspeed": "0.19.8"},
              "results": results, "commit": harness.commit(),
              "command": "python -m bench.inference " + " ".join(sys.argv[1:] if argv is None else argv)}
    print("\n".join(batch_table(results)))
    harness.save_json(record, args.json, indent=1)
    if args.results_md:
        write_section(record, args.results_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
