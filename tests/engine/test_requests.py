"""Per-request behaviour through the whole engine: stop strings, n, min_tokens, logprobs, errors."""

from __future__ import annotations

import pytest
import torch

from memwall import LLM, SamplingParams
from memwall.engine.processor import InvalidRequestError
from memwall.loader.errors import ModelLoadError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # fp32 KV: the logprobs below are held to HF's float32 within 1e-4 (the CPU's default fp16 KV
    # moves them by ~2e-3; benchmarks/quality.py measures what that costs)
    return LLM(str(tiny_model_dir("qwen2")), num_kv_blocks=256, block_size=4, max_model_len=256,
               kv_cache_dtype="fp32")


def token_texts(llm, ids):
    return [llm.tokenizer.decode([t]) for t in ids]


def test_stop_string_split_across_tokens_is_found_and_excluded(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    pieces = token_texts(llm, full.token_ids)
    # A stop string made of the end of token 5 and the start of token 6 (both non-empty).
    i = next(i for i in range(4, len(pieces) - 1) if len(pieces[i]) >= 1 and len(pieces[i + 1]) >= 1
             and pieces[i].strip() and pieces[i + 1].strip())
    prefix = "".join(pieces[:i])
    stop = pieces[i][-1:] + pieces[i + 1][:1]
    expected_cut = (prefix + pieces[i] + pieces[i + 1]).find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:expected_cut]
    assert stop not in out.text
    kept = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=True,
                                               **GREEDY))[0].outputs[0]
    assert kept.text == full.text[:expected_cut] + stop


def test_n_samples_are_distinct_and_each_complete(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate("Once upon a time", params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_min_tokens_masks_eos_and_ignore_eos_runs_to_length(llm):
    eos = llm.tokenizer.eos_token_id
    # Make EOS the greedy choice by banning nothing else: a stop_token that greedy picks at once.
    first = llm.generate("Hello", SamplingParams(max_tokens=1, **GREEDY))[0].outputs[0].token_ids[0]
    stopped = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]))
    assert stopped[0].outputs[0].token_ids == [first] and stopped[0].outputs[0].stop_reason == first
    delayed = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first],
                                                   min_tokens=3))[0].outputs[0]
    assert len(delayed.token_ids) >= 3 and first not in delayed.token_ids[:3]
    run = llm.generate("Hello", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True,
                                               stop_token_ids=[]))[0].outputs[0]
    assert len(run.token_ids) == 7 and run.finish_reason == "length"
    assert eos is not None


def test_logprobs_equal_log_softmax_of_reference_logits(llm, tiny_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), torch_dtype=torch.float32)
    prompt = [5, 60, 70, 200, 31]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for step, (entry, token) in enumerate(zip(out.outputs[0].logprobs, out.outputs[0].token_ids)):
        row = ref[len(prompt) - 1 + step]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(entry)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) <= 3
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(ref[len(prompt) - 1 + s, t].item() for s, t in enumerate(out.outputs[0].token_ids)), abs=1e-3)


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ([5, 99999], SamplingParams(), "outside the vocabulary"),
    ("word " * 400, SamplingParams(), "maximum context length is 256"),
    ("hi", SamplingParams(max_tokens=300), "maximum context length is 256"),
])
def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(llm, prompt, params, match):
    engine = llm.engine
    engine.add_request("survivor", [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert list(finished) == ["survivor"] and len(finished["survivor"].outputs[0].token_ids) == 5
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n must be"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path / "not-a-model"))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_out_of_vocab_stop_token_ids_are_rejected_up_front(llm):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.engine.add_request("oov", [5, 6], SamplingParams(stop_token_ids=[10**6], min_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_final_text_equals_joined_deltas(llm):
    engine = llm.engine
    engine.add_request("d", "Caf\u00e9 \U0001f680", SamplingParams(max_tokens=30, **GREEDY))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output.outputs[0]
    assert "".join(deltas) == final.text


def test_plain_greedy_steps_skip_the_sampler_and_mixed_batches_keep_each_rows_rules(llm, monkeypatch):
    """Rows that are plain greedy (no logprobs, penalties, min_tokens or grammar) take their
    argmax without the sampler's metadata; one row that needs the sampler sends the whole
    step through it, and each request's tokens are those it gets alone."""
    from memwall.sample import metadata

    built = []
    real = metadata.SamplingMetadata.build.__func__
    monkeypatch.setattr(metadata.SamplingMetadata, "build",
                        classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    prompts = ["The quick brown fox", "Once upon a time there", "A B A B A B A"]
    plain = SamplingParams(max_tokens=16, **GREEDY)
    alone = [llm.generate(p, plain)[0].outputs[0].token_ids for p in prompts]
    assert not built  # plain greedy decoding never built the sampler's metadata
    penalized = SamplingParams(max_tokens=16, repetition_penalty=1.8, **GREEDY)
    penalized_alone = llm.generate(prompts[2], penalized)[0].outputs[0].token_ids
    assert built and penalized_alone != alone[2]
    built.clear()
    together = llm.generate(prompts, [plain, plain, penalized])
    assert built  # the penalized row took the batch through the sampler
    assert [o.outputs[0].token_ids for o in together] == alone[:2] + [penalized_alone]
