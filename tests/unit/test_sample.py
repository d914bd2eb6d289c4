"""The generated sample: seeded, cropped to the model's context, decoded safely."""

from __future__ import annotations

import torch

from syncline.data.text import ByteDataset
from syncline.train.config import TrainConfig
from syncline.train.sample import Sample, decode, generate, prompt_from, sample_for


class _Recorder:
    """A 'model' that records its input lengths; uniform over 7 tokens (the draws are the
    sampler's alone)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.lengths.append(x.shape[1])
        return torch.zeros(x.shape[0], x.shape[1], 7)


def test_generation_is_seeded_and_sees_at_most_the_context() -> None:
    model = _Recorder()
    a = generate(model, torch.tensor([[1, 2, 3]]), 6, context=5, seed=3)
    b = generate(_Recorder(), torch.tensor([[1, 2, 3]]), 6, context=5, seed=3)
    c = generate(_Recorder(), torch.tensor([[1, 2, 3]]), 6, context=5, seed=4)
    assert a.shape == (1, 6) and torch.equal(a, b) and not torch.equal(a, c)
    assert model.lengths == [3, 4, 5, 5, 5, 5]


def test_prompt_decode_and_what_gets_no_sample() -> None:
    data = ByteDataset(b"def main():\n    return 0\n" * 4, 16)
    prompt = prompt_from(data, 16)
    assert decode(prompt, data) == "def main"  # half the context, held-out data's start
    assert decode(torch.tensor([104, 105, 10, 27, 255]), None) == "hi\n\ufffd\ufffd"

    class Tokenized:
        def decode(self, ids: list[int]) -> str:
            return "|".join(map(str, ids))

    assert decode(torch.tensor([5, 300]), Tokenized()) == "5|300"
    assert decode(torch.tensor([5, 300]), None) == "5 300"
    cfg = TrainConfig(seq_len=16, sample_tokens=4)
    cpu = torch.device("cpu")
    logits = lambda x: torch.zeros(1, x.shape[1], 256)  # noqa: E731
    assert sample_for(cfg, logits, data, 1, cpu) is None  # not a language model
    assert sample_for(TrainConfig(seq_len=16, sample_tokens=0), logits, data, 16, cpu) is None
    sample = sample_for(cfg, logits, data, 16, cpu)
    assert isinstance(sample, Sample) and sample.prompt == "def main" and sample.tokens == 4
    assert sample.render().startswith("--- prompt (held out) ---\ndef main\n--- generated (4")
