"""Speculators: per decode step, k candidate token ids per row for the exit predictors.

- DraftSpeculator: an EAGLE-1-style draft head (Linear over [token embedding; base feature],
  one Llama decoder layer with its own KV cache, the base model's LM head). Checkpoints use
  EAGLE-1's layout (config.json + `fc.*`, `layers.0.*` keys), so public EAGLE-1 heads load.
- PromptLookupSpeculator: training-free n-gram lookup in the row's own prompt and output,
  completed from a fallback speculator (or the row's most frequent tokens) when short of k.

Features ("f") are the base model's hidden states after the final RMSNorm; EAGLE pairs the
token x_t with f_{t-1} and regresses f_t, whose LM-head top-k are the candidates for x_{t+1}.
"""
from __future__ import annotations

import copy

import json
import logging
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specee_core.model.config import ModelConfig
from specee_core.model.kv_cache import KVCache
from specee_core.model.loader import read_state_dict
from specee_core.model.model import LayerWeights, Linear, LlamaModel, ModelWeights, make_linear, rms_norm
from specee_core.model.quant import select_rows
from specee_core.model.rope import apply_rope

log = logging.getLogger(__name__)


class DraftHead(nn.Module):
    """Trainable parameters of the draft head; the base model's embedding and LM head are shared
    and frozen. `forward` is the full-sequence (training) path; inference goes through
    `as_model()`, which reuses the engine's cached decoder layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        d, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        self.config = c
        self.vocab_subset: torch.Tensor | None = None  # [V'] token ids the draft ranks; None = all
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.wqkv = nn.Parameter(torch.empty(q + 2 * kv, d))
        self.wo = nn.Parameter(torch.empty(d, q))
        self.post_norm = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Parameter(torch.empty(2 * inter, d))
        self.w_down = nn.Parameter(torch.empty(d, inter))
        for w in (self.wqkv, self.wo, self.w_gate_up, self.w_down):
            nn.init.normal_(w, std=0.02)
        with torch.no_grad():  # start near "the next feature is the current one"
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            self.fc.bias.zero_()

    def layer_weights(self) -> LayerWeights:
        return LayerWeights(input_norm=None, wqkv=self.wqkv, bqkv=None, wo=self.wo, bo=None, post_norm=self.post_norm,
                            w_gate_up=self.w_gate_up, b_gate_up=None, w_down=self.w_down, b_down=None)

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """emb, feat [N, T, D] (token x_{t+1}, feature f_t) -> predicted f_{t+1} [N, T, D], causal."""
        c = self.config
        n, t, _ = emb.shape
        h = self.fc(torch.cat((emb, feat), dim=-1))
        q, k, v = F.linear(h, self.wqkv).split((c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                                                 c.num_key_value_heads * c.head_dim), dim=-1)
        q = apply_rope(q.view(n, t, -1, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(n, t, -1, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(n, t, -1, c.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        h = h + F.linear(o.transpose(1, 2).reshape(n, t, -1), self.wo)
        gate, up = F.linear(rms_norm(h, self.post_norm, c.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.w_down)

    def state_dict_eagle(self) -> dict[str, torch.Tensor]:
        """EAGLE-1 key layout."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        wq, wk, wv = self.wqkv.detach().split((q, kv, kv))
        wg, wu = self.w_gate_up.detach().split((inter, inter))
        p = "layers.0."
        return {"fc.weight": self.fc.weight.detach(), "fc.bias": self.fc.bias.detach(),
                p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
                p + "self_attn.o_proj.weight": self.wo.detach(), p + "mlp.gate_proj.weight": wg,
                p + "mlp.up_proj.weight": wu, p + "mlp.down_proj.weight": self.w_down.detach(),
                p + "post_attention_layernorm.weight": self.post_norm.detach()}

    def save(self, path: str | Path, meta: dict | None = None, vocab_subset: torch.Tensor | None = None) -> None:
        """EAGLE-1 layout; vocab_subset [V'] (token ids the draft ranks, optional) is stored
        beside the weights under its own key, which EAGLE loaders ignore."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
               "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
               "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
               "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
               "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "specee": meta or {}}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        tensors = {k: v.contiguous().to(torch.bfloat16) for k, v in self.state_dict_eagle().items()}
        if vocab_subset is not None:
            tensors["vocab_subset"] = vocab_subset.to(torch.int64).contiguous()
        save_file(tensors, str(path / "model.safetensors"))

    @classmethod
    def load(cls, path: str | Path, base: ModelConfig) -> DraftHead:
        """Load a draft head in EAGLE-1 layout (ours or the public repository's) for base model `base`.
        A stored vocabulary subset ends up in head.vocab_subset (None when absent)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"draft head config not found: {path / 'config.json'}")
        tensors, origin = read_state_dict(path)
        head = cls(base)
        c = base
        d = c.hidden_size
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        p = "layers.0."
        expect = {"fc.weight": (d, 2 * d), p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                  p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                  p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                  p + "mlp.down_proj.weight": (d, inter), p + "post_attention_layernorm.weight": (d,)}
        for name, shape in expect.items():
            if name not in tensors:
                raise ValueError(f"{path}: draft tensor {name!r} missing")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{origin[name]}: draft tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {shape} for this base model")
        g = lambda k: tensors[k].float()  # noqa: E731
        with torch.no_grad():
            head.fc.weight.copy_(g("fc.weight"))
            head.fc.bias.copy_(g("fc.bias") if "fc.bias" in tensors else torch.zeros(d))
            head.wqkv.copy_(torch.cat([g(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            head.wo.copy_(g(p + "self_attn.o_proj.weight"))
            head.w_gate_up.copy_(torch.cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")]))
            head.w_down.copy_(g(p + "mlp.down_proj.weight"))
            head.post_norm.copy_(g(p + "post_attention_layernorm.weight"))
        subset = tensors.get("vocab_subset")
        if subset is not None and (subset.dim() != 1 or int(subset.max()) >= c.vocab_size or int(subset.min()) < 0):
            raise ValueError(f"{origin['vocab_subset']}: vocab_subset must be token ids in [0, {c.vocab_size})")
        head.vocab_subset = subset
        return head.eval().requires_grad_(False)


class Speculator:
    """Proposes k candidate ids per row. `start` sees the prefill; `propose` is called once per
    decode step for the alive rows, with the token being fed and the previous feature."""
    k: int
    scores = False  # propose_scored gives probabilities (predictors of feature set "zpdq" need them)

    def start(self, prompt_ids: list[list[int]], features: torch.Tensor, lens: torch.Tensor, max_len: int) -> None:
        """features [B, T, D]: normed prefill features (right-padded), lens [B]."""

    def admit(self, prompt_ids: list[list[int]], features: torch.Tensor, lens: torch.Tensor, rows: list[int]) -> None:
        """Continuous batching: batch rows `rows` start new prompts (features and lens as in start)."""

    def caches(self) -> list:
        """The KV caches it keeps (the draft head's), which grow with the target's."""
        return []

    def defer(self, rows: list[int], tokens: torch.Tensor, features: torch.Tensor) -> None:
        """A decode step that drafts nothing (SpecEE's dense steps): the rows fed tokens [N] with the
        previous features [N, D]; a speculator with a cache takes these pairs in with its next proposal."""

    def fork(self) -> Speculator:
        """A speculator sharing this one's weights with per-batch state of its own (its cache): each
        stepper drafts with its own, so batches that run side by side (continuous batching's lanes)
        never touch each other's rows."""
        return copy.copy(self)

    def propose(self, rows: list[int], history: list[list[int]], tokens: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        """rows: batch rows; history[b]: every token of row b so far (prompt + generated, the fed
        token last); tokens [N] fed now; features [N, D] of the previous position -> [N, K]."""
        raise NotImplementedError

    def propose_scored(self, rows: list[int], history: list[list[int]], tokens: torch.Tensor,
                       features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """propose's candidates [N, K] and the speculator's own probabilities of them [N, K] fp32
        (None when it has none): what predictors trained with the draft's confidence read."""
        return self.propose(rows, history, tokens, features), None


class DraftSpeculator(Speculator):
    """use_subset: rank only the head's vocab_subset (frequent tokens) with a smaller LM-head
    product, as FR-Spec does; rarer tokens then never become candidates."""
    scores = True

    def __init__(self, head: DraftHead, model: LlamaModel, k: int = 4, use_subset: bool = True):
        self.k = k
        self.subset = head.vocab_subset.to(model.device) if use_subset and head.vocab_subset is not None else None
        self.subset_head = None if self.subset is None else make_linear(select_rows(model.w.lm_head, self.subset))  # [V', D]
        self.model_base = model
        dtype, dev = model.dtype, model.device
        lw = head.to(device=dev, dtype=dtype).layer_weights()
        lw = LayerWeights(**{f: (None if t is None else t.detach()) for f, t in vars(lw).items()})
        self.fc = Linear(head.fc.weight.detach(), head.fc.bias.detach())  # [D, 2D]
        self.draft = LlamaModel(model.config, ModelWeights(embed=model.w.embed, layers=[lw], norm=model.w.norm,
                                                           lm_head=model.w.lm_head), dev, dtype)
        self.cache: KVCache | None = None

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, rows, n_valid=None,
                tree: torch.Tensor | None = None):
        """tokens [N, T], feats [N, T, D] at positions [N, T] of cache rows `rows` (None = all) -> draft output
        features [N, T, D], their K/V appended to the draft cache; tree: see LlamaModel.layer."""
        m = self.draft
        h = self.fc(torch.cat((m.embed(tokens), feats), dim=-1))
        return m.layer(0, h, m.rope_for(positions), self.cache, rows, n_valid, tree)

    def caches(self) -> list:
        return [] if self.cache is None else [self.cache]

    def new_cache(self, batch: int, max_len: int) -> None:
        """An empty draft cache of `batch` rows (start makes one for a batch's prompts)."""
        self.cache = self.draft.new_cache(batch, max_len)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Drop draft-cache entries of rows [N] (host) past lengths [N] (drafted nodes, whose features were
        guesses): the draft head alone cuts its cache."""
        self.cache.truncate(rows, lengths)

    def start(self, prompt_ids, features, lens, max_len) -> None:
        self.new_cache(features.shape[0], max_len)
        self.deferred: dict[int, tuple[list[int], list[torch.Tensor]]] = {}  # row -> pairs not fed yet
        self._prefill(prompt_ids, features, lens, None)

    def admit(self, prompt_ids, features, lens, rows) -> None:
        for b in rows:
            self.deferred.pop(b, None)
        self.truncate(torch.tensor(rows), torch.zeros(len(rows), dtype=torch.int64))
        # rows come in any order: index them unless they are exactly the cache's rows in order
        sub = None if rows == list(range(self.cache.batch)) else torch.tensor(rows, device=features.device)
        self._prefill(prompt_ids, features, lens, sub)

    def _prefill(self, prompt_ids, features, lens, rows) -> None:
        n, t, _ = features.shape
        if t < 2:
            return
        # pairs (x_{i+1}, f_i) for i < len - 1 at draft position i; the last pair comes with the first decode step
        toks = torch.zeros(n, t - 1, dtype=torch.int64)
        for b, p in enumerate(prompt_ids):
            toks[b, : len(p) - 1] = torch.tensor(p[1:])
        dev = features.device
        self.forward(toks.to(dev), features[:, :-1], torch.arange(t - 1, device=dev).expand(n, t - 1), rows,
                   n_valid=(lens - 1).clamp(min=0))

    def defer(self, rows, tokens, features) -> None:
        for b, t, f in zip(rows, tokens.tolist(), features):
            toks, feats = self.deferred.setdefault(b, ([], []))
            toks.append(int(t))
            feats.append(f[None])

    def feed(self, rows: list[int], tokens: list[list[int]], features: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feeds each row's true pairs (tokens[r] with features[r] [c_r, D], c_r >= 1) in one chunk after
        what its draft cache holds. Returns (synced [N]: the cache lengths before, counts [N]: the pairs
        fed, f [N, D]: the predicted feature after each row's last pair), lengths on the host."""
        dev = self.model_base.device
        n, t = len(rows), max(len(x) for x in tokens)
        toks = torch.zeros(n, t, dtype=torch.int64)
        feats = torch.zeros(n, t, features[0].shape[-1], dtype=features[0].dtype, device=features[0].device)
        counts = torch.tensor([len(x) for x in tokens])
        for r, (x, f) in enumerate(zip(tokens, features)):
            toks[r, : len(x)] = torch.tensor(x)
            feats[r, : len(x)] = f
        synced = self.cache.lengths[0, torch.tensor(rows)].clone()
        positions = (synced[:, None] + torch.arange(t)).to(dev)
        sub = None if rows == list(range(self.cache.batch)) else torch.tensor(rows, device=dev)
        n_valid = None if bool((counts == t).all()) else counts
        out = self.forward(toks.to(dev), feats.to(dev), positions, sub, n_valid)  # [N, t, D]
        return synced, counts, out[torch.arange(n, device=dev), (counts - 1).to(dev)]

    def _draft(self, rows, tokens, features) -> torch.Tensor:
        """One draft step for the rows (after the pairs deferred by steps that drafted nothing): the
        predicted next features [N, D]."""
        if any(b in self.deferred for b in rows):
            late = [self.deferred.pop(b, ([], [])) for b in rows]
            return self.feed(rows, [x + [int(t)] for (x, _), t in zip(late, tokens.tolist())],
                             [torch.cat(f + [features[r : r + 1]]) for r, (_, f) in enumerate(late)])[2]
        idx = torch.tensor(rows, device=tokens.device)
        positions = (self.cache.lengths[0, idx.cpu()]).to(tokens.device)[:, None]
        sub = idx if len(rows) < self.cache.batch else None
        return self.forward(tokens[:, None], features[:, None], positions, sub)[:, 0]

    def propose(self, rows, history, tokens, features) -> torch.Tensor:
        return self.top(self._draft(rows, tokens, features), self.k)

    def propose_scored(self, rows, history, tokens, features) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ids = self.top_log_probs(self._draft(rows, tokens, features), self.k)
        return ids, logp.exp()

    def top_log_probs(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft output features [..., D] -> (log-probabilities [..., k] fp32, token ids [..., k]) of the
        k most likely next tokens, best first (normalised over the frequent-token subset, when ranked)."""
        logits = self.model_base.lm_head(out) if self.subset is None else self.subset_head(out)
        logp, idx = logits.float().log_softmax(-1).topk(k, dim=-1)
        return logp, (idx if self.subset is None else self.subset[idx])

    def full_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft output features [N, D] -> logits [N, V] fp32 over the whole vocabulary (-inf outside the
        frequent-token subset, when the head ranks one)."""
        if self.subset is None:
            return self.model_base.lm_head(out).float()
        logits = torch.full((out.shape[0], self.model_base.config.vocab_size), float("-inf"), device=out.device)
        return logits.index_copy_(1, self.subset, self.subset_head(out).float())

    def top(self, out: torch.Tensor, k: int) -> torch.Tensor:
        """Draft output features [N, D] -> the k most likely next tokens [N, k], best first (through
        the base's LM head, or its frequent-token subset)."""
        if self.subset is None:
            return self.model_base.lm_head(out).topk(k, dim=-1).indices  # the base's head, shared
        return self.subset[self.subset_head(out).topk(k, dim=-1).indices]


def ngram_matches(hist: list[int], max_ngram: int):
    """Where earlier occurrences of hist's last n tokens (n = max_ngram..1, longest first; the latest
    occurrence first) are followed by something: yields the index of the token after each match."""
    for n in range(min(max_ngram, len(hist) - 1), 0, -1):
        tail = hist[-n:]
        for i in range(len(hist) - n - 1, -1, -1):
            if hist[i : i + n] == tail:
                yield i + n


class NgramIndex:
    """Prompt lookup in O(max_ngram) per query instead of a scan of the row's history: per row, the latest
    start of every n-gram (n <= max_ngram) that some token follows, brought up to date with the tokens the
    row gained since the last query. Answers as spec.proposers.LookupProposer.continuation does (a test checks)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.rows: dict[int, tuple[dict[tuple[int, ...], int], int]] = {}  # row -> (n-gram -> start, tokens seen)

    def reset(self, row: int) -> None:
        self.rows.pop(row, None)

    def _index(self, row: int, hist: list[int]) -> dict[tuple[int, ...], int]:
        """The row's index, brought up to date with hist (the row's prompt and output so far)."""
        index, seen = self.rows.get(row, ({}, 0))
        size = len(hist)
        for end in range(max(seen, 1), size):  # the n-grams hist[end - n:end], followed by hist[end]
            for n in range(1, min(self.max_ngram, end) + 1):
                index[tuple(hist[end - n : end])] = end - n
        self.rows[row] = (index, size)
        return index

    def continuation(self, row: int, hist: list[int], depth: int) -> list[int]:
        index, size = self._index(row, hist), len(hist)
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            start = index.get(tuple(hist[size - n :]))
            if start is not None:
                return hist[start + n : start + n + depth]
        return []

    def followers(self, row: int, hist: list[int]) -> list[int]:
        """Per n = 1..max_ngram: the token that followed the latest earlier occurrence of hist's last n
        tokens, -1 where there is none."""
        index, size = self._index(row, hist), len(hist)
        out = [-1] * self.max_ngram
        for n in range(1, min(self.max_ngram, size - 1) + 1):
            start = index.get(tuple(hist[size - n :]))
            if start is not None:
                out[n - 1] = hist[start + n]
        return out


LOOKUP_NGRAM = 3  # the longest n-gram the lookup veto reads (NgramIndex.followers)


def lookup_tokens(followers: torch.Tensor, min_ngram: int) -> torch.Tensor:
    """followers [S, n_max] (NgramIndex.followers per row) -> [S]: the token that followed the latest
    earlier occurrence of the row's longest matching n-gram with n >= min_ngram, -1 where none matches."""
    out = torch.full(followers.shape[:1], -1, dtype=torch.int64, device=followers.device)
    for n in range(min_ngram, followers.shape[1] + 1):  # a longer match overrides
        out = torch.where(followers[:, n - 1] >= 0, followers[:, n - 1], out)
    return out


def lookup_veto(exit_tokens: torch.Tensor, looked_up: torch.Tensor) -> torch.Tensor:
    """Where an exit's token [S] (or [S, L-1]) contradicts prompt lookup's token looked_up [S] (-1: none):
    the text is being copied from the prompt or the output so far, and the exit would emit something else
    (measured on HumanEval: exits that rewrote a signature the prompt spells out)."""
    lk = looked_up if exit_tokens.dim() == 1 else looked_up[:, None]
    return (lk >= 0) & (exit_tokens != lk)


class PromptLookupSpeculator(Speculator):
    """Candidates from earlier continuations of the row's latest n-gram (n = max_ngram..1),
    most recent first; short lists are completed by `fallback`, then by the row's most
    frequent tokens."""

    def __init__(self, k: int = 4, max_ngram: int = 3, fallback: Speculator | None = None, vocab_size: int = 0):
        self.k, self.max_ngram, self.fallback, self.vocab_size = k, max_ngram, fallback, vocab_size

    def start(self, prompt_ids, features, lens, max_len) -> None:
        if self.fallback is not None:
            self.fallback.start(prompt_ids, features, lens, max_len)

    def admit(self, prompt_ids, features, lens, rows) -> None:
        if self.fallback is not None:
            self.fallback.admit(prompt_ids, features, lens, rows)

    def caches(self) -> list:
        return [] if self.fallback is None else self.fallback.caches()

    def fork(self) -> PromptLookupSpeculator:
        twin = copy.copy(self)
        twin.fallback = None if self.fallback is None else self.fallback.fork()
        return twin

    def defer(self, rows, tokens, features) -> None:
        if self.fallback is not None:
            self.fallback.defer(rows, tokens, features)

    def lookup(self, hist: list[int]) -> list[int]:
        found: list[int] = []
        for start in ngram_matches(hist, self.max_ngram):
            if hist[start] not in found:
                found.append(hist[start])
                if len(found) == self.k:
                    break
        return found

    def propose(self, rows, history, tokens, features) -> torch.Tensor:
        cands = [self.lookup(history[b]) for b in rows]
        extra = None
        if self.fallback is not None:
            extra = self.fallback.propose(rows, history, tokens, features).tolist()
        out = []
        for j, (b, c) in enumerate(zip(rows, cands)):
            pool = (extra[j] if extra else []) + [t for t, _ in Counter(history[b]).most_common(2 * self.k)]
            pool += list(range(2 * self.k))  # a row too short to fill k: any distinct ids
            for t in pool:
                if len(c) == self.k:
                    break
                if t not in c:
                    c.append(t)
            out.append(c)
        return torch.tensor(out, dtype=torch.int64, device=tokens.device)
