"""Make a small Llama-family Hugging Face checkpoint with no download.

Random weights (deterministic for a seed) and a byte-level BPE tokenizer trained
locally with ``tokenizers``, both written with ``save_pretrained``, so vLLM loads
it through its real loading path::

    python -m vllm_neuron_sched.testing.checkpoint /tmp/tiny-llama
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"

# Checkpoints made once and reused by later runs (demo, benchmarks, stress).
CACHE_DIR = Path.home() / ".cache" / "vllm_neuron_sched"
DEFAULT_CHECKPOINT = CACHE_DIR / "tiny-llama"

# A ChatML-style template, so the OpenAI chat endpoint works on the checkpoint.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SYLLABLES = (
    "ka ri to na me su lo vi de pa ne sho gu ra fe ti mo ya zu el an or is "
    "un ba ce di fo ha ju ki li mu no pe qu re se tu ve wa xi yo ze"
).split()
_COMMON = (
    "the a of and to in is it that for on with as was by at be this from "
    "request token step batch decode prefill device host future cache"
).split()


@dataclass(frozen=True)
class CheckpointSpec:
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    intermediate: int = 512
    max_positions: int = 2048
    seed: int = 0
    # Larger than Llama's 0.02 so random logits have clear winners and
    # greedy decoding is stable across batch shapes.
    init_range: float = 0.08

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _corpus(seed: int, num_words: int = 60_000) -> list[str]:
    rng = random.Random(seed)
    lexicon = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        for _ in range(4000)
    ]
    words = [
        rng.choice(_COMMON) if rng.random() < 0.3 else rng.choice(lexicon)
        for _ in range(num_words)
    ]
    return [" ".join(words[i : i + 40]) + "." for i in range(0, num_words, 40)]


def _train_tokenizer(spec: CheckpointSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=[BOS, EOS, UNK, PAD, "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(path: str | Path, spec: CheckpointSpec | None = None) -> Path:
    """Write the checkpoint to ``path`` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or CheckpointSpec()
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(
            f"hidden ({spec.hidden}) must divide by heads ({spec.heads}) and "
            f"heads by kv_heads ({spec.kv_heads})"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "neuron_sched_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
    return path


def ensure_checkpoint(
    path: Path = DEFAULT_CHECKPOINT, spec: CheckpointSpec | None = None
) -> Path:
    """``path``, made with ``spec`` the first time: a run that finds a
    checkpoint there uses it (random weights take seconds to a minute)."""
    if not (path / "config.json").exists():
        make_checkpoint(path, spec)
    return path


def main(argv: list[str] | None = None) -> None:
    defaults = CheckpointSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="output folder (created)")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = CheckpointSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate or 2 * args.hidden,
        seed=args.seed,
    )
    out = make_checkpoint(args.dir, spec)
    print(f"wrote {out} (head_dim {spec.head_dim})")


if __name__ == "__main__":
    main()
