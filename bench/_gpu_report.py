"""bench/gpu_check.py's markdown: a table of the stages, each with its one-line result, then each
stage's details. Built from the JSON alone, after every stage (a stage not run yet is absent)."""
from __future__ import annotations

from typing import Optional

from bench import _gpu_infer, _gpu_lora, _gpu_sanitize

GiB = 1 << 30
DEEPNVME = {"gpu": "DeepNVMe: GPU buffers about as fast as CPU buffers",
            "gds": "DeepNVMe: GDS up to 37% faster"}


def _f(x: Optional[float], digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def run_line(r: dict) -> str:
    """One training run or plain torch's, in a few words (the progress lines)."""
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "error" in r:
        return f"failed: {r['error']}"
    if "compute_s" in r:
        its = ", ".join(f"k={k} {s:.3f} s" for k, s in r.get("iteration_s", {}).items())
        return f"forward + backward {r['compute_s'] * 1e3:.1f} ms on {r.get('device')}; iterations {its}"
    return (f"{r['median_s']:.3f} s/iteration on {r.get('device')} ({r['path']}), read {r['read_bytes'] / GiB:.3f} GiB, "
            f"written {r['write_bytes'] / GiB:.3f} GiB, init {r['init_s']} s")


# -- one line per stage ------------------------------------------------------------------------------

def _install(st: dict) -> str:
    p = st.get("probe", {})
    if "version" not in p:
        return st.get("error", "")
    uring = next((s["io_uring"] for s in st.get("steps", []) if s.get("io_uring")), None)
    gpu = p.get("gpu") or "no CUDA device"
    gds = "gds_handle runs" if p.get("gds_unavailable") is None else "gds_handle: " + p["gds_unavailable"][:120]
    where = "tree" if p["nvmeio_from"] == "tree" else "installed package"
    return (f"nvmeio {p['version']} from the {where} ({p['nvmeio']}); backends {', '.join(p['backends'])}"
            + (f" ({uring})" if uring else "") + f"; torch {p.get('torch')} (CUDA {p.get('torch_cuda')}), {gpu}; {gds}")


def _tests(st: dict) -> str:
    if "passed" not in st:
        return st.get("error", "")
    return f"{st['passed']} passed, {st['failed']} failed, {st['errors']} errors, {st['skipped']} skipped"


def _disk(st: dict) -> str:
    if st.get("read_gbps") is None:
        return st.get("error", "")
    return (f"nvme_tune's best: read {st['read_gbps']:.2f} GiB/s, write {st['write_gbps']:.2f} GiB/s "
            f"({st.get('io_size', 0) / GiB:.2f} GiB per op, direct I/O {st.get('direct_io')}); fio: {st.get('fio') or 'absent'}")


def _aio_ratios(st: dict) -> dict:
    g = st.get("gibps", {})
    host = g.get("host (locked)", {})
    dev = next((v for k, v in g.items() if "aio_handle" in k), {})
    gds = g.get("CUDA tensor, gds_handle", {})
    return {op: {"device/host": _ratio(dev.get(op), host.get(op)), "gds/host": _ratio(gds.get(op), host.get(op)),
                 "gds/device": _ratio(gds.get(op), dev.get(op))} for op in ("write", "read")}


def _aio(st: dict) -> str:
    if "gibps" not in st:
        return st.get("error", "")
    r = _aio_ratios(st)
    text = (f"device buffer / host buffer: write {_f(r['write']['device/host'])}, read {_f(r['read']['device/host'])} "
            f"({DEEPNVME['gpu']})")
    if "gds_skipped" in st:
        return text + f"; gds_handle not run: {st['gds_skipped'][:120]}"
    return (text + f"; gds_handle / host: write {_f(r['write']['gds/host'])}, read {_f(r['read']['gds/host'])}, "
            f"/ aio_handle: write {_f(r['write']['gds/device'])}, read {_f(r['read']['gds/device'])} ({DEEPNVME['gds']}; "
            f"compat mode {st.get('gds_compat_mode')}, device path {st.get('gds_device_path', 'cufile')}"
            + _forced_cufile(st) + ")")


def _forced_cufile(st: dict) -> str:
    """cuFile's own figures where the handle staged CUDA tensors (no GPUDirect path)."""
    g = st.get("gibps", {})
    forced, host = g.get("CUDA tensor, gds_handle, cuFile forced"), g.get("host (locked)", {})
    if not forced:
        return ""
    return (f"; cuFile forced / host: write {_f(_ratio(forced.get('write'), host.get('write')))}, "
            f"read {_f(_ratio(forced.get('read'), host.get('read')))}")


def _train_rows(st: dict) -> list:
    out = []
    for row in st.get("runs", []):
        comp = st.get("compute", {}).get(row["dtype"], {})
        torch_s = comp.get("iteration_s", {}).get(str(row["k"]))
        disk = (row.get("disk") or {}).get("seconds")
        dmin = (st.get("disk_min", {}).get(row["dtype"]) or {}).get("seconds")
        floor = dmin + row["k"] * comp["compute_s"] if dmin is not None and "compute_s" in comp else None
        out.append((row, torch_s, disk, floor))
    return out


def _train(st: dict) -> str:
    parts = []
    for row, torch_s, disk, floor in _train_rows(st):
        if "median_s" not in row:
            continue
        s = row["median_s"]
        parts.append(f"{row['dtype']} k={row['k']}: {s:.3f} s, / torch {_f(_ratio(s, torch_s))}, "
                     f"/ disk {_f(_ratio(s, disk))}, / floor {_f(_ratio(s, floor))}")
    return "; ".join(parts) or st.get("error", "")


def _lora(st: dict) -> str:
    parts = [f"{_gpu_lora.pair_name(m, d)}: bytes {_gpu_lora.moved(on) / _gpu_lora.moved(off):.2f}x, seconds "
             f"{on['median_s'] / off['median_s']:.2f}x (quantized / not); / disk {_f(_gpu_lora.to_disk(off))} and "
             f"{_f(_gpu_lora.to_disk(on))}" for m, d, off, on in _gpu_lora.pairs(st)]
    return "; ".join(parts) or st.get("error", "")


SUMMARIES = {"install": _install, "tests": _tests, "sanitize": _tests, "disk": _disk, "aio": _aio, "train": _train, "lora": _lora,
             "infer": _gpu_infer.summary}


# -- the document ----------------------------------------------------------------------------------

def markdown(record: dict) -> str:
    m, stages = record["meta"], record["stages"]
    probe = stages.get("install", {}).get("probe", {})
    lines = [f"# GPU check: {probe.get('gpu') or 'no CUDA device'}", ""]
    if m.get("rehearse"):
        lines += ["**Rehearsal (--rehearse): the CPU, tiny sizes, nothing installed: a check of the check, "
                  "not a measurement.**", ""]
    lines += [f"{m['started']}, commit {m['commit']}, host {m['host']}: {m['nproc']} CPUs, "
              f"{m['ram_bytes'] / GiB:.0f} GiB RAM, kernel {m['kernel']}, Python {m['python']}; scratch files on "
              f"{m.get('disk')} ({m.get('fstype')}); {m.get('elapsed_s', '…')} s in all. Command: `{m['command']}`.", "",
              "| stage | status | s (budget) | result |", "|---|---|---:|---|"]
    for name, st in stages.items():
        result = SUMMARIES[name](st) if st["status"] not in ("skipped",) else st.get("error", "")
        note = f" *{st['note']}.*" if st.get("note") else ""
        error = (f" **{st['error']}**" if st.get("error") and st["status"] not in ("ok", "dry")
                 and st["error"] not in result else "")
        lines.append(f"| {name} | {st['status']} | {st['seconds']} ({st['budget_s']}) | "
                     f"{(result + error + note).replace('|', '/')} |")
    lines.append("")
    lines += _tests_details(stages.get("tests", {}))
    lines += _tests_details(stages.get("sanitize", {}), "Tests under the CUDA sanitizer")
    lines += _gpu_sanitize.details(stages.get("sanitize", {})) + _aio_details(stages.get("aio", {}))
    lines += _train_details(stages.get("train", {})) + _lora_details(stages.get("lora", {}))
    lines += _gpu_infer.details(stages.get("infer", {}))
    lines += _install_details(stages.get("install", {}))
    return "\n".join(lines) + "\n"


def _tests_details(st: dict, heading: str = "Tests") -> list:
    if not st.get("runs"):
        return []
    out = [f"## {heading}", "", "| pytest run | passed | failed | errors | skipped | exit | s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in st["runs"]:
        out.append(f"| {r['title']} | {r.get('passed', '—')} | {r.get('failed', '—')} | {r.get('errors', '—')} | "
                   f"{r.get('skipped', '—')} | {r['returncode']} | {r['seconds']} |")
    failures = [f for r in st["runs"] for f in r.get("failures", [])]
    out += [""] + [f"- {f['kind']}: `{f['test']}`: {f['message']}" for f in failures[:20]]
    return out + ([f"- … and {len(failures) - 20} more (gpu_check.json)"] if len(failures) > 20 else []) + [""]


def _aio_details(st: dict) -> list:
    if "gibps" not in st:
        return []
    out = ["## aio_handle and gds_handle", "",
           f"{st['bytes'] / GiB:.2f} GiB written then read back (checked) per buffer, the median of the rounds, the "
           f"buffers taking turns; settings {st['settings']}.", "",
           "| buffer | write GiB/s | read GiB/s |", "|---|---:|---:|"]
    out += [f"| {b} | {v['write']:.2f} | {v['read']:.2f} |" for b, v in st["gibps"].items()]
    return out + [""]


def _train_details(st: dict) -> list:
    if not st.get("runs") and not st.get("compute"):
        return []
    mdl = st.get("model", {})
    out = ["## Training: params and optimizer on NVMe against plain torch in memory and the disk", "",
           f"GPT {mdl.get('layers')} x d {mdl.get('d_model')} (vocab {mdl.get('vocab')}), micro-batches of 1 x 8 tokens "
           f"on {st.get('device')}; ours: bench/io_bound.py's configuration, `train_batch` of k micro-batches, the "
           "median iteration; plain torch: the model and AdamW (fused) in memory on the same device, k micro-batches "
           "and a step; disk: the time for the same bytes (nvme_tune's best read and write one after the other, or "
           "fio's read and write jobs at once where fio runs); floor: the disk's time for the iteration's minimum "
           "bytes + k x plain torch's forward + backward.", "",
           "| dtype | k | ours s/it | torch s/it | ours / torch | read GiB | written GiB | disk s (source) | "
           "ours / disk | floor s | ours / floor | init s | peak RSS GiB | GPU peak GiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, torch_s, disk, floor in _train_rows(st):
        head = f"| {row['dtype']} | {row['k']} |"
        if "median_s" not in row:
            out.append(head + f" {run_line(row).replace('|', '/')} |" + " |" * 12)
            continue
        s, src = row["median_s"], (row.get("disk") or {}).get("source", "—")
        gpu = row.get("cuda_peak_bytes")
        out.append(head + f" {s:.3f} | {_f(torch_s, 3)} | {_f(_ratio(s, torch_s))} | {row['read_bytes'] / GiB:.3f} | "
                   f"{row['write_bytes'] / GiB:.3f} | {_f(disk, 3)} ({src}) | {_f(_ratio(s, disk))} | {_f(floor, 3)} | "
                   f"{_f(_ratio(s, floor))} | {row['init_s']} | {row['peak_rss_bytes'] / GiB:.2f} | "
                   f"{_f(gpu / GiB if gpu else None)} |")
    out.append("")
    for dtype, comp in st.get("compute", {}).items():
        out.append(f"- plain torch {dtype}: " + run_line(comp))
    for row in st.get("runs", []):
        if "busiest_thread" in row:
            w = row["warmup"]

            def mean(values: list) -> float:  # over the measured iterations
                return sum(values[w:]) / max(1, len(values) - w)
            names = ", ".join(sorted({name for name, _ in row["busiest_thread"][w:]}))
            out.append(f"- ours {row['dtype']} k={row['k']}, a measured iteration's mean: "
                       f"{mean(row['times_s']):.3f} s, blocked on NVMe {mean(row['blocked_s']):.3f} s, the busiest "
                       f"thread's CPU {mean([t for _, t in row['busiest_thread']]):.3f} s ({names}), the process's "
                       f"CPU {mean(row['cpu_s']):.3f} s")
    return out + [""]


def _lora_details(st: dict) -> list:
    if not st.get("runs"):
        return []
    models = st.get("models") or {_gpu_lora.STAND_IN: st.get("model", {})}
    shapes = "; ".join(f"{name}: GPT {m.get('layers')} x d {m.get('d_model')}" for name, m in models.items())
    out = ["## LoRA on a frozen base on NVMe, without and with zero_quantized_nontrainable_weights", "",
           f"bench/lora.py's LoRA on {st.get('device')} ({shapes}) with rank "
           "8 adapters, the base frozen on NVMe (int8, a scale per 256 elements, with the flag), AdamW in host memory, "
           "micro-batches of 1 x 8 tokens, the median iteration; bytes: the parameter swapper's; disk: the disk "
           "stage's time for those bytes.", "",
           "| model | dtype | quantized | s/it | swapper read GiB | written GiB | disk s | / disk | init s |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in st["runs"]:
        head = f"| {row.get('lora_model', _gpu_lora.STAND_IN)} | {row['dtype']} | {'yes' if row['flag'] else 'no'} |"
        if "median_s" not in row:
            out.append(head + f" {_gpu_lora.line(row).replace('|', '/')} |" + " |" * 5)
            continue
        disk = (row.get("disk") or {}).get("seconds")
        out.append(head + f" {row['median_s']:.3f} | {row['swap_read_bytes'] / GiB:.3f} | "
                   f"{row['swap_write_bytes'] / GiB:.4f} | {_f(disk, 3)} | {_f(_gpu_lora.to_disk(row))} | "
                   f"{row['init_s']} |")
    out.append("")
    for m, d, off, on in _gpu_lora.pairs(st):
        out.append(f"- {_gpu_lora.pair_name(m, d)}: quantized / unquantized: bytes {_gpu_lora.moved(on) / _gpu_lora.moved(off):.3f}x, "
                   f"seconds {on['median_s'] / off['median_s']:.3f}x")
    for row in st["runs"]:
        if "phases" in row:
            ph = row["phases"]
            out.append(f"- {_gpu_lora.pair_name(row.get('lora_model', _gpu_lora.STAND_IN), row['dtype'])}, "
                       f"{'quantized' if row['flag'] else 'unquantized'}, one more iteration phase "
                       f"by phase (the device synchronized after each): forward {ph['forward']:.3f} s, backward "
                       f"{ph['backward']:.3f} s, step {ph['step']:.3f} s, flush {ph['flush']:.3f} s; blocked on NVMe "
                       f"{ph['blocked']:.3f} s; busiest thread {ph['busiest_thread'][0]} "
                       f"{ph['busiest_thread'][1]:.2f} s CPU")
    return out + [""]


def _install_details(st: dict) -> list:
    if not st:
        return []
    out = ["## Install", ""]
    plan = st.get("plan", {})
    for w in plan.get("wheels", []):
        out.append(f"- {w['wheel']}: installed here {w['installed'] or 'no'}, "
                   f"{'installs' if w['install'] else 'kept'}{'' if w['fits_cp312'] else ' (NOT for cp312)'}")
    out += [f"- `{' '.join(cmd)}`" for _, cmd in plan.get("commands", [])]
    out += [f"- warning: {w}" for w in st.get("warnings", [])]
    return out + [""]
