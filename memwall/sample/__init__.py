"""Sampling: turn one step's logits into tokens (and, on request, logprobs).

``SamplingMetadata.build`` packs the per-request ``SamplingParams`` of a batch into [B]
tensors; ``Sampler`` runs the pipeline; ``compute_logprobs`` is shared with prompt logprobs.
"""

from memwall.sample.logprobs import LogprobsTensors, compute_logprobs
from memwall.sample.metadata import SamplingMetadata
from memwall.sample.sampler import Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "SamplingMetadata", "Sampler", "SamplerOutput", "compute_logprobs"]
