"""gpu_ci.sh's summary: one markdown table, a line per step (its status from
logs/steps.tsv and a headline read from what the step left in results/ or logs/), written
to $WORK/summary.md and results/gpu-ci-<gpu>.md.

    WORK=... GPU_CI_SECONDS=... BUDGET=... python scripts/gpu_ci_summary.py
"""
import datetime as dt
import glob
import json
import math
import os
import re
import subprocess
import xml.etree.ElementTree as ET

out = os.environ["WORK"]
logs, results = os.path.join(out, "logs"), os.path.join(out, "results")
env = json.load(open(os.path.join(logs, "env.json")))


def junit(name):
    path = os.path.join(logs, f"{name}.xml")
    if not os.path.exists(path):
        return ""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return f"{n - f - e - s} passed, {f + e} failed, {s} skipped"


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def bench_headline():
    return (attention_headline() + layer_ops_headline() + sampling_headline()
            + quant_headline()).lstrip("; ")


def attention_headline(folder=None):
    files = glob.glob(os.path.join(folder or results, "kernels-*.json"))
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    parts = []
    for op in ("decode", "prefill"):
        for base in ("sdpa-flash", "sdpa-default", "flex", "flash-attn"):
            g = geomean([r.get("triton_speedup") for r in rows
                         if r["op"] == op and r["impl"] == base])
            if g:
                parts.append(f"{op} {g:.2f}x vs {base}")
    return ("Triton speedup (baseline ms / Triton ms, geomean): " + ", ".join(parts)
            if parts else "no baseline ran")


def moe_headline():
    files = [f for f in glob.glob(os.path.join(results, "moe-*.json"))
             if not os.path.basename(f).startswith("moe-sweep-")]
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    parts = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        at256 = [r.get("speedup_of_triton-fused") for r in mine
                 if r["tokens"] == 256 and r["impl"] == "torch-per-expert-loop"]
        bw = [r["bw_frac"] for r in mine
              if r["impl"] == "triton-fused" and r["tokens"] <= 16 and "bw_frac" in r]
        q4 = [r["bw_frac"] for r in mine
              if r["impl"] == "triton-fused-gguf-q4_0" and r["tokens"] <= 16 and "bw_frac" in r]
        if at256 and at256[0]:
            parts.append(f"{model} {at256[0]:.1f}x vs loop at M=256"
                         + (f", weight-read bw {min(bw):.0%}-{max(bw):.0%} of copy at M<=16"
                            if bw else "")
                         + (f", Q4_0 experts {min(q4):.0%}-{max(q4):.0%}" if q4 else ""))
    return ", ".join(parts)


def fused_headline(prefix, label, describe):
    """'; <label>: <describe(row)>, ...' over the rows of <prefix>-*.json that were timed
    fused (only a GPU run times the Triton side)."""
    files = glob.glob(os.path.join(results, prefix + "-*.json"))
    if not files:
        return ""
    rows = [r for r in json.load(open(files[0]))["results"] if "speedup" in r]
    parts = [describe(r) for r in rows]
    parts = [p for p in parts if p]
    return (f"; {label}: " + ", ".join(parts)) if parts else ""


def layer_ops_headline():
    return fused_headline(
        "layer-ops", "layer elementwise chain fused vs torch",
        lambda r: (f"{r['speedup']:.1f}x at {r['tokens']} tokens ({r['bw_frac']:.0%} of "
                   "copy bw)") if r["op"] == "layer chain" else "")


def sampling_headline():
    return fused_headline("sampling", "temperature sampling fused vs torch",
                          lambda r: f"{r['speedup']:.1f}x at {r['rows']}x{r['vocab']}"
                          + ("" if r.get("filters", "none") == "none"
                             else f" ({r['filters']})"))


def quant_headline():
    """'; GGUF matmul (<n> types): M=1 weight-read bw a-b% of copy, M=256 x-y the speed
    of dense bf16' over the rows of bench_quant_kernels's file."""
    files = glob.glob(os.path.join(results, "quant-kernels-*.json"))
    if not files:
        return ""
    rows = json.load(open(files[0]))["results"]
    bw = [r["bw_frac"] for r in rows if r["M"] == 1]
    gemm = [r["dense_over_gguf"] for r in rows if r["M"] == 256]
    parts = []
    if bw:
        parts.append(f"M=1 weight-read bw {min(bw):.0%}-{max(bw):.0%} of copy")
    if gemm:
        parts.append(f"M=256 {min(gemm):.2f}-{max(gemm):.2f}x the speed of dense bf16")
    types = len({r["type"] for r in rows})
    return (f"; GGUF matmul ({types} types): " + ", ".join(parts)) if parts else ""


def compile_headline():
    path = os.path.join(logs, "compile", "compile-check.json")
    if not os.path.exists(path):
        return junit("compile-grid")
    data = json.load(open(path))
    rs = [r for r in data["results"] if "canary" not in r["case"]]
    regs = max((r["regs"] for r in rs), default=0)
    shared = max((r["shared"] for r in rs), default=0)
    return (f"{len(rs)} kernels (sm_80 + sm_90), {len(data['failing'])} failing cases; "
            f"max {regs} registers, max {shared} B shared; " + junit("compile-grid"))


def e2e_headline():
    parts = []
    for name, label in (("throughput-cuda", "overlap on"),
                        ("throughput-cuda-sync", "overlap off")):
        path = os.path.join(results, name + ".json")
        if os.path.exists(path):
            d = json.load(open(path))["deepinfer"]
            parts.append(f"{label}: {d['tok_per_s']:.0f} tok/s ({d['tokens']} tokens in "
                         f"{d['seconds']:.1f}s)")
    return "; ".join(parts)


def structured_headline():
    path = os.path.join(results, "structured-cuda.json")
    if not os.path.exists(path):
        return ""
    d = json.load(open(path))
    modes = d["modes"]
    base = modes["unconstrained"]["tok_s"]
    cost = 1 - modes["constrained"]["tok_s"] / base
    text = (f"batch {d['batch']}: constrained {modes['constrained']['tok_s']:.0f} vs "
            f"unconstrained {base:.0f} tok/s ({cost:+.1%} cost; target <= 10%)")
    off = modes.get("constrained, no overlap")
    if off:
        text += f"; constrained without overlap {off['tok_s']:.0f} tok/s"
    one = modes.get("constrained, 1 fill thread")
    if one:
        text += f"; with 1 mask-fill thread {one['tok_s']:.0f} tok/s"
    return text + f"; {d['valid_outputs']}/{d['batch']} valid JSON"


def sweep_headline():
    files = glob.glob(os.path.join(results, "moe-sweep-*.json"))
    if not files:
        return ""
    d = json.load(open(files[0]))
    worst = max((x for x in d["summary"] if x["rule_over_best"]),
                key=lambda x: x["rule_over_best"], default=None)
    text = f"{len(d['results'])} configurations" + ("" if d["meta"]["complete"] else " (cut)")
    if worst:
        text += (f"; rule / best at most {worst['rule_over_best']:.2f}x ({worst['model']} "
                 f"M={worst['tokens']} {worst['gemm']})")
    return text


headlines = {
    "env": f"{env['gpu']} ({env['capability']}), torch {env['torch']}, CUDA {env['cuda']}, "
           f"triton {env['triton']}, flash-attn {env['flash_attn'] or 'not installed'}",
    "compile-grid": compile_headline(),
    "kernel-tests": junit("kernel-tests"),
    "engine-tests": junit("engine-tests"),
    "engine-slow": junit("engine-slow"),
    "flex-bench": attention_headline(os.path.join(results, "flex")),
    "moe-bench": moe_headline(),
    "kernel-bench": bench_headline(),
    "e2e-throughput": e2e_headline(),
    "structured": structured_headline(),
    "moe-sweep": sweep_headline(),
}
steps = [line.rstrip("\n").split("\t") for line in open(os.path.join(logs, "steps.tsv"))]
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=10).stdout.strip()
except Exception:
    commit = ""
if not commit:  # the device machine gets the tree without .git: gpu_prepare.sh's record
    commit = os.environ.get("GIT_COMMIT", "unknown")
date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
total = int(os.environ.get("GPU_CI_SECONDS", "0"))
lines = [f"# GPU CI: {env['gpu']}", "",
         f"commit `{commit}`, {date}, total {total} s "
         f"(budget {os.environ.get('BUDGET', '?')} s)", "",
         "| step | status | seconds | result |", "|---|---|---:|---|"]
for name, status, secs, _rc in steps:
    lines.append(f"| {name} | {status} | {secs} | {headlines.get(name, '')} |")
lines += ["", "Files: " + ", ".join(sorted(os.path.basename(p)
                                        for p in glob.glob(os.path.join(results, "*"))))]
md = "\n".join(lines) + "\n"
slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
for path in (os.path.join(out, "summary.md"), os.path.join(results, f"gpu-ci-{slug}.md")):
    open(path, "w").write(md)
print("\n" + md)
