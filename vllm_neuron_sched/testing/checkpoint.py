"""Make a small Llama-family Hugging Face checkpoint with no download.

Random weights (deterministic for a seed) and a byte-level BPE tokenizer trained
locally with ``tokenizers``, both written with ``save_pretrained``, so vLLM loads
it through its real loading path::

    python -m vllm_neuron_sched.testing.checkpoint /tmp/tiny-llama

``--trained`` instead makes a target and a draft model trained (about half a
minute on one core) to continue short token cycles, for speculative decoding::

    python -m vllm_neuron_sched.testing.checkpoint --trained /tmp/repeat
"""

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, UNK, PAD, "<|user|>", "<|assistant|>", "<|system|>")

# Checkpoints made once and reused by later runs (demo, benchmarks, stress).
CACHE_DIR = Path.home() / ".cache" / "vllm_neuron_sched"
DEFAULT_CHECKPOINT = CACHE_DIR / "tiny-llama"
TRAINED_CHECKPOINT = CACHE_DIR / "tiny-llama-repeat"
DRAFT_CHECKPOINT = CACHE_DIR / "tiny-llama-repeat-draft"

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
    # > 0: every other layer attends to this many tokens back (a hybrid model,
    # as Gemma's: a sliding-window KV cache group beside the full one).
    sliding_window: int = 0
    # > 0: a mixture of experts (Mixtral) of this many, two per token.
    num_experts: int = 0

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
        special_tokens=list(SPECIAL_TOKENS),
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


def _check(spec: CheckpointSpec) -> None:
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(
            f"hidden ({spec.hidden}) must divide by heads ({spec.heads}) and "
            f"heads by kv_heads ({spec.kv_heads})"
        )


def _config(spec: CheckpointSpec, tokenizer):
    from transformers import LlamaConfig, MixtralConfig

    kind: dict = {}
    config_cls = LlamaConfig
    if spec.sliding_window:
        kind["sliding_window"] = spec.sliding_window
        kind["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(spec.layers)
        ]
    if spec.num_experts:
        config_cls = MixtralConfig
        kind |= {"num_local_experts": spec.num_experts, "num_experts_per_tok": 2}
    return config_cls(
        **kind,
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


def make_checkpoint(path: str | Path, spec: CheckpointSpec | None = None) -> Path:
    """Write the checkpoint to ``path`` (created) and return it."""
    import torch
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    spec = spec or CheckpointSpec()
    _check(spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(path)

    config = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model_cls = MixtralForCausalLM if spec.num_experts else LlamaForCausalLM
    model = model_cls(config).to(torch.float32).eval()
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


# The projections a test adapter adapts (vLLM packs q/k/v and gate/up).
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def make_lora_adapter(
    checkpoint: str | Path,
    path: str | Path,
    seed: int,
    rank: int = 8,
    scale: float = 0.5,
) -> Path:
    """A random LoRA adapter for ``checkpoint``'s attention and MLP
    projections, in PEFT's format (``adapter_config.json``,
    ``adapter_model.safetensors``); ``scale``: its weights' standard
    deviation (the default changes a random model's greedy tokens)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    q = config["num_attention_heads"] * head_dim
    inter = config["intermediate_size"]
    shapes = {  # (in, out)
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(layers):
        for name in LORA_TARGET_MODULES:
            fan_in, fan_out = shapes[name]
            block = (
                "self_attn"
                if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else "mlp"
            )
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            weights[f"{prefix}.lora_A.weight"] = scale * torch.randn(
                rank, fan_in, generator=generator
            )
            weights[f"{prefix}.lora_B.weight"] = scale * torch.randn(
                fan_out, rank, generator=generator
            )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, path / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LORA_TARGET_MODULES),
        "bias": "none",
        "base_model_name_or_path": str(checkpoint),
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path


# Trained checkpoints for speculative decoding. The models learn a fixed
# successor map whose orbits are short cycles over the whole non-special vocab:
# the next token depends on the last one only, which two tiny models learn
# exactly in seconds on a CPU (copying an arbitrary phrase needs induction
# heads, which do not form in that budget). Greedy output from any prompt thus
# cycles with a period of 4-12 tokens: the n-gram proposer finds what follows
# in the prompt or in earlier output. The draft is trained on the same map with
# every other cycle reversed (``DRAFT_REVERSE_EVERY``): on the other cycles it
# agrees with the target token for token (its drafts are all accepted), on the
# reversed ones it proposes each token's predecessor (none is accepted). Its
# KV heads differ from the target's, so their KV specs differ too (vLLM then
# puts both in one group of different page sizes, as for real draft models);
# four query heads split over TP=4.
TRAINED_SPEC = CheckpointSpec(
    layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, init_range=0.02
)
DRAFT_SPEC = CheckpointSpec(
    layers=1, hidden=128, heads=4, kv_heads=1, intermediate=256, init_range=0.02
)
DRAFT_REVERSE_EVERY = 2
TRAINED_MARKER = "neuron_sched_trained.json"
# Bumped when the recipe changes, so cached checkpoints are remade.
_RECIPE_VERSION = 1
_MIN_PERIOD, _MAX_PERIOD = 4, 12
_BATCH, _SEQ_LEN, _LR = 64, 32, 1e-2
# One thread: a fixed count keeps training deterministic, and at these sizes a
# second thread gains under 1.5x on an idle machine but loses 10x or more when
# another process holds a core (OpenMP threads wait on each other).
_THREADS = 1


def _cycles(ids: list[int], seed: int) -> list[list[int]]:
    """``ids`` shuffled and cut into cycles of 4-12 tokens."""
    rng = random.Random(seed)
    ids = list(ids)
    rng.shuffle(ids)
    cycles, i = [], 0
    while i < len(ids):
        rest = len(ids) - i
        n = (
            rest
            if rest <= _MAX_PERIOD
            else min(rng.randint(_MIN_PERIOD, _MAX_PERIOD), rest - _MIN_PERIOD)
        )
        cycles.append(ids[i : i + n])
        i += n
    return cycles


def _train(model, cycles: list[list[int]], bos: int, steps: int, seed: int) -> float:
    """Train ``model`` in place on walks along ``cycles``; return the mean loss
    of the last tenth of the steps.

    Each row is a random-length prefix of random tokens (BOS first in half the
    rows), then a walk from a random token: the model learns to follow the map
    after arbitrary context. Rows start at random positions over the whole
    ``max_position_embeddings``, so long prompts stay in distribution.
    """
    import torch

    ids = torch.tensor([t for c in cycles for t in c])
    succ = torch.arange(model.config.vocab_size)
    for c in cycles:
        succ[torch.tensor(c)] = torch.tensor(c[1:] + c[:1])
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=_LR, total_steps=steps, pct_start=0.1
    )
    pos = torch.arange(_SEQ_LEN).expand(_BATCH, -1)
    max_start = model.config.max_position_embeddings - _SEQ_LEN
    losses = []
    model.train()
    for _step in range(steps):
        chain = [ids[torch.randint(len(ids), (_BATCH,), generator=g)]]
        for _ in range(_SEQ_LEN - 1):
            chain.append(succ[chain[-1]])
        walk = torch.stack(chain, 1)
        start = torch.randint(1, _SEQ_LEN // 2, (_BATCH, 1), generator=g)
        noise = ids[torch.randint(len(ids), (_BATCH, _SEQ_LEN), generator=g)]
        x = torch.where(pos >= start, walk.gather(1, (pos - start).clamp(min=0)), noise)
        x[torch.rand(_BATCH, generator=g) < 0.5, 0] = bos
        # Only tokens after the walk's first are predictable.
        labels = x.masked_fill(pos <= start, -100)
        offset = torch.randint(max_start + 1, (_BATCH, 1), generator=g)
        loss = model(input_ids=x, position_ids=pos + offset, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return sum(tail) / len(tail)


def make_trained_checkpoint(
    path: str | Path,
    spec: CheckpointSpec | None = None,
    steps: int = 150,
    seed: int = 0,
    reverse_every: int = 0,
) -> Path:
    """Write a checkpoint trained to follow the cycle map to ``path`` and
    return it.

    ``spec`` (default ``TRAINED_SPEC``) sets the shape, the tokenizer and the
    initial weights, as for ``make_checkpoint``; ``seed`` sets the cycles and
    the training data, so a target and a draft made with the same ``seed`` and
    ``spec.vocab`` share tokenizer and map. ``reverse_every``: cycle ``i`` is
    learnt backwards where ``i % reverse_every == 1`` (a draft that is right
    on some cycles and wrong on the others). Deterministic for a machine:
    torch trains on one thread, whatever the machine has.
    """
    import time

    import torch
    from transformers import LlamaForCausalLM

    spec = spec or TRAINED_SPEC
    _check(spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / TRAINED_MARKER).unlink(missing_ok=True)

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(path)
    special = set(tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)))
    cycles = _cycles([i for i in range(len(tokenizer)) if i not in special], seed)
    if reverse_every:
        cycles = [
            c[::-1] if i % reverse_every == 1 else c for i, c in enumerate(cycles)
        ]

    threads = torch.get_num_threads()
    torch.set_num_threads(_THREADS)
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(_config(spec, tokenizer)).to(torch.float32)
        began = time.perf_counter()
        loss = _train(model, cycles, tokenizer.bos_token_id, steps, seed)
        train_s = time.perf_counter() - began
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path, safe_serialization=True)
    (path / "neuron_sched_spec.json").write_text(json.dumps(spec.__dict__, indent=2))
    marker = {
        "version": _RECIPE_VERSION,
        "task": "successor map: each token is followed by the next in its cycle",
        "seed": seed,
        "steps": steps,
        "batch": _BATCH,
        "seq_len": _SEQ_LEN,
        "lr": _LR,
        "final_loss": round(loss, 4),
        "train_s": round(train_s, 1),
        "spec": spec.__dict__,
        "reverse_every": reverse_every,
        "cycles": cycles,
    }
    # Written last: its presence means the checkpoint is complete.
    (path / TRAINED_MARKER).write_text(json.dumps(marker))
    return path


def _marker(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / TRAINED_MARKER).read_text())


def ensure_trained_checkpoints(
    target: Path = TRAINED_CHECKPOINT, draft: Path = DRAFT_CHECKPOINT
) -> tuple[Path, Path]:
    """``(target, draft)``, each trained the first time (or when its recipe
    changed) with ``TRAINED_SPEC`` and ``DRAFT_SPEC``; together about half a
    minute on one core."""
    for path, spec, reverse in (
        (target, TRAINED_SPEC, 0),
        (draft, DRAFT_SPEC, DRAFT_REVERSE_EVERY),
    ):
        want = (_RECIPE_VERSION, spec.__dict__, reverse)
        have = None
        if (path / TRAINED_MARKER).exists():
            marker = _marker(path)
            have = (
                marker["version"],
                marker.get("spec"),
                marker.get("reverse_every", 0),
            )
        if have != want:
            make_trained_checkpoint(path, spec, reverse_every=reverse)
    return target, draft


def successor_map(checkpoint: str | Path) -> dict[int, int]:
    """The token a trained checkpoint predicts after each token, so a test can
    state its exact greedy output: from a prompt ending in ``t``, it is
    ``succ[t], succ[succ[t]], ...``."""
    return {
        t: c[(i + 1) % len(c)]
        for c in _marker(checkpoint)["cycles"]
        for i, t in enumerate(c)
    }


def repeat_prompt_ids(
    checkpoint: str | Path, seed: int, length: int = 32, noise: int = 0
) -> list[int]:
    """A prompt of ``noise`` random tokens, then ``length`` tokens walking one
    cycle of a trained checkpoint (picked by ``seed``). The greedy output
    carries the walk on, so with ``length`` of two periods or more (periods
    are at most 12) the n-gram proposer matches from the first step."""
    cycles = _marker(checkpoint)["cycles"]
    rng = random.Random(seed)
    ids = [t for c in cycles for t in c]
    cycle = rng.choice(cycles)
    at = rng.randrange(len(cycle))
    walk = [cycle[(at + i) % len(cycle)] for i in range(length)]
    return [rng.choice(ids) for _ in range(noise)] + walk


def main(argv: list[str] | None = None) -> None:
    defaults = CheckpointSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="output folder (created)")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="write a trained target to DIR and its draft to DIR-draft, with "
        "TRAINED_SPEC and DRAFT_SPEC (shape flags are ignored; --seed picks "
        "the cycles)",
    )
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    if args.trained:
        target = Path(args.dir)
        for path, spec, reverse in (
            (target, TRAINED_SPEC, 0),
            (Path(f"{target}-draft"), DRAFT_SPEC, DRAFT_REVERSE_EVERY),
        ):
            out = make_trained_checkpoint(
                path, spec, seed=args.seed, reverse_every=reverse
            )
            marker = _marker(out)
            print(f"wrote {out} (loss {marker['final_loss']}, {marker['train_s']} s)")
        return
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
