"""The embedded default model: a tiny Llama trained from scratch, with a word-level tokenizer
trained locally with `tokenizers` on text the env, its prompts and every memory produce. No
download; a standard HF model + tokenizer, so the rest of the code treats it like any hub model.

Shape (why): hidden 64 with 2 heads gives head_dim 32 (vLLM's CPU attention needs >= 32); init
std 0.1, not HF's 0.02 -- at 0.02 attention starts near-uniform and the model long cannot tell
which digit is which coordinate (a measured plateau); tied embeddings keep it at ~0.1M parameters.
"""

import json
import os
import random

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>"]
HIDDEN, LAYERS, HEADS = 64, 2, 2  # the default model's shape (above: why); a test of another builds it here
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}act{% endif %}"
)


def corpus(env_name, episodes=200, seed=0, env_kwargs=None):
    """Every string the tiny model can be shown or asked to say, from random episodes of the env as
    --env_args configures it (WebShop and Search need their data_dir there): a random admissible
    action each step, the empty action (a no-op) where the env lists none."""
    from envs import make_env
    from memory import MEMORIES, make_memory
    from prompts import prompt_module

    env, prompt, rng = make_env(env_name, **(env_kwargs or {})), prompt_module(env_name), random.Random(seed)
    yield "act"
    for ep in range(episodes):
        obs, info = env.reset(seed=10**8 + ep)
        mems = [make_memory(name) for name in MEMORIES]
        for m in mems:
            m.reset(info["task"])
        done, step = False, 0
        while not done:
            yield " ".join(info["admissible_actions"])
            for m in mems:
                for msg in prompt.build(info["task"], m.text(), obs, info["admissible_actions"], step):
                    yield msg["content"]
            action = rng.choice(info["admissible_actions"] or [""])  # none listed: the empty (no-op) action
            new_obs, r, term, trunc, info = env.step(action)
            for m in mems:
                m.add(obs, action, r)
            obs, done, step = new_obs, term or trunc, step + 1


def is_tiny(model):
    """--model "tiny", or a folder saved from a tiny-model run (out/model: its tokenizer carries the
    tiny chat template). Such a model gets the terse prompt it was trained on, not the chat prompt."""
    if model == "tiny":
        return True
    jinja, config = os.path.join(model, "chat_template.jinja"), os.path.join(model, "tokenizer_config.json")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read() == CHAT_TEMPLATE
    if os.path.isfile(config):
        with open(config) as f:
            return json.load(f).get("chat_template") == CHAT_TEMPLATE
    return False


def build_tokenizer(env_name, env_kwargs=None):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(
        Regex(r"[(),]"), ""
    )  # "at (1, 3)" -> "at 1 3": 7 prompt tokens, not 16
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation("isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    from envs import (
        env_module,
    )  # an env with slow resets (ALFWorld) sets fewer corpus episodes; unseen words -> <unk>

    episodes = getattr(
        env_module(env_name), "TINY_CORPUS_EPISODES", 200
    )  # the optional hook (envs/__init__.py)
    tok.train_from_iterator(
        corpus(env_name, episodes, env_kwargs=env_kwargs), trainers.WordLevelTrainer(special_tokens=SPECIALS)
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny(
    env_name="treasure", hidden=HIDDEN, layers=LAYERS, heads=HEADS, init_std=0.1, seed=0, env_kwargs=None
):
    import torch

    tokenizer = build_tokenizer(env_name, env_kwargs)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer
