"""A worker that loaded its model keeps rotary tables as long as the context window: the last
position still works, and the tables of a model handed in (maybe shared) are left alone."""

from __future__ import annotations

from memwall import LLM, SamplingParams
from memwall.layers.rotary import RotaryEmbedding


def _tables(llm) -> list[int]:
    model = llm.engine.core.executor.worker.model
    return [m.cos.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding)]


def test_tables_cut_to_the_context_window_and_the_last_position_works(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4, max_model_len=48)
    assert _tables(llm) == [48]
    out = llm.generate([list(range(4, 44))], SamplingParams(temperature=0, max_tokens=8,
                                                            ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8  # positions 40..47: the window's last one


def test_a_model_handed_in_is_not_cut(tiny_model_dir):
    from memwall.config import EngineArgs
    from memwall.engine.llm_engine import LLMEngine
    from memwall.loader.model_loader import load_model

    loaded = load_model(str(tiny_model_dir("llama")))
    before = [m.cos.shape[0] for m in loaded.model.modules() if isinstance(m, RotaryEmbedding)]
    LLMEngine.from_args(EngineArgs(num_kv_blocks=64, block_size=4, max_model_len=32), loaded)
    after = [m.cos.shape[0] for m in loaded.model.modules() if isinstance(m, RotaryEmbedding)]
    assert after == before and before[0] > 32
