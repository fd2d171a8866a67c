"""Tokenization: the `Tokenizer` wrapper (HF directory or GGUF), chat templates, streaming detokenizer."""

from memwall.tokenizer.chat_template import render_chat_template
from memwall.tokenizer.detokenizer import IncrementalDetokenizer
from memwall.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError", "IncrementalDetokenizer", "render_chat_template"]
