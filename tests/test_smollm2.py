"""Integration on the real embedded model, SmolLM2-135M-Instruct (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from specfree import Engine

pytestmark = pytest.mark.model

ARTICLE = (
    "Summarize the following article in two sentences.\n\n"
    "The town council of Millbrook voted on Tuesday to convert the old railway station into a public "
    "library. The railway station, built in 1894, has been empty since the line closed in 1972. "
    "Council members said the library will open in the spring of next year and will include a reading "
    "room, a children's corner and a small museum about the history of the railway. The project will cost "
    "four million dollars, most of which will come from a state grant for historic buildings. Residents "
    "who attended the meeting said they were happy that the railway station will be used again, and several "
    "offered to volunteer at the new library when it opens."
)


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    # exact: these tests compare with transformers' own generate() on the same model
    engine = Engine.from_pretrained("smollm2", "autoregressive", precision="exact")
    return engine.adapter.model, engine.tokenizer


def plain_greedy(model, tokenizer, messages, max_new_tokens):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_chat_answer_is_fluent_and_identical_to_plain_greedy(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = Engine.from_model(model, tokenizer, "prompt_lookup", num_candidates=2, precision="exact")
    result = engine.generate(messages, max_new_tokens=24)
    assert result.tokens == plain_greedy(model, tokenizer, messages, 24)
    assert "Paris" in result.text


def test_prompt_lookup_needs_fewer_forwards_than_tokens_on_a_summary(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": ARTICLE}]
    engine = Engine.from_model(model, tokenizer, "prompt_lookup", precision="exact")
    chunks, stream = [], engine.stream(messages, max_new_tokens=48)
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as done:
            result = done.value
            break
    assert result.tokens == plain_greedy(model, tokenizer, messages, 48)
    assert result.forwards < len(result.tokens)
    assert any(flag for chunk in chunks for flag in chunk.from_draft)
    assert "".join(c.text for c in chunks) == result.text  # streamed text adds up to the result


def test_a_datastore_of_the_models_own_answers_drafts_its_next_answers(smollm2, tmp_path):
    from specfree.datastore import main as datastore_main

    model, tokenizer = smollm2
    question = "Write a short thank-you note to a colleague."
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["%s"]}\n{"prompt": "Name three colours."}\n' % question)
    out = tmp_path / "self.sfds"
    assert datastore_main(["answers", f"prompts={prompts}", f"out={out}", "max_new_tokens=24"]) == 0
    assert len((tmp_path / "self.answers.jsonl").read_text().splitlines()) == 2
    messages = [{"role": "user", "content": question}]
    engine = Engine.from_model(model, tokenizer, "hybrid", drafters=["prompt_lookup", "retrieval"], datastore=str(out),
                               precision="exact")
    result = engine.generate(messages, max_new_tokens=24)
    assert result.tokens == plain_greedy(model, tokenizer, messages, 24)
    # The answer is in the datastore now, so retrieval drafts most of it again.
    assert sum(step.sources.get("retrieval", 0) for step in result.steps) >= 8


def test_its_gguf_weights_are_held_as_codes_with_the_float32_bits(smollm2):
    """SmolLM2 ships as a Q4_1 GGUF (a Q8_0 head): every linear layer is held as its codes, and at
    precision=exact a step's logits are those of the same weights as float32 panels, bit for bit."""
    from specfree.kernels import linear_path, load_kernels
    from specfree.kernels.codes import CodedLinear
    from specfree.kernels.panels import PanelLinear
    from specfree.loading import load_model

    if load_kernels(progress=False) is None:
        pytest.skip("the kernel cannot be built or run on this machine")
    model, tokenizer = smollm2
    layers = [m for m in model.modules() if isinstance(m, PanelLinear)]
    assert len(layers) == 211 and all(isinstance(m, CodedLinear) for m in layers)
    assert model.lm_head.coded.kind == "scaled8" and {m.coded.kind for m in layers[:-1]} == {"affine4"}
    held = sum(m.coded.nbytes() for m in layers)
    assert held < 0.185 * sum(4 * m.in_features * m.out_features for m in layers)  # float16 scales
    fp32, _ = load_model("smollm2")
    Engine.from_model(fp32, tokenizer, "autoregressive", linear_kernel="few_row_fp32", compile=False)
    assert linear_path(fp32).startswith("few_row-panels") and linear_path(model).startswith("few_row-coded")
    ids = tokenizer("The railway station, built in 1894, has been", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp32(ids).logits)
