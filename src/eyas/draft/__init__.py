"""The EAGLE-3 draft head (vLLM's `LlamaForCausalLMEagle3`), its vocabulary and the TTT loss."""

from eyas.draft.model import Eagle3Draft
from eyas.draft.spec import DraftSpec, draft_config_dict
from eyas.draft.vocab import DraftVocab, build_draft_vocab

__all__ = ["DraftSpec", "Eagle3Draft", "DraftVocab", "build_draft_vocab", "draft_config_dict"]
