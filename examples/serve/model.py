"""A small mixture-of-experts decoder, shaped like the models ferry serves (DeepSeek-V3,
Qwen3-MoE) and small enough for a CPU: GQA attention over a paged KV cache (HND pages), RMSNorm,
RoPE, and an MoE FFN of routed experts plus one shared expert. It knows nothing of ferry: the
roles that serve it (prefill.py, decode.py) shard it and pass in their collectives.

Numerics. Arithmetic runs in float64, the KV cache holds float32, and the MoE traffic is bf16
(what ferry's AllToAll moves): each routed expert reads its input rounded to bf16 and returns
bf16, and the combine sums weight x output in float32 over a token's experts in ascending
expert id, rounded to bf16 at the end. Every way of sharding the model -- tensor-parallel
attention, experts on other ranks, chunked prefill, batched decode -- changes only the order of
float64 sums, which moves a value by about 1e-16 of itself; the odds that such a move crosses a
float32 or bf16 rounding boundary are about 1e-9 per value. So a served run and the colocated
reference (`generate`) give the same greedy tokens, and the tests compare them for equality.
"""

import dataclasses
import json
import math
import os

import torch

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    hidden: int = 256            # a multiple of 16, as ferry's AllToAll wants of bf16 rows
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2            # GQA: 4 query heads per KV head
    head_dim: int = 32
    page_tokens: int = 16
    experts: int = 16
    top_k: int = 4
    expert_inter: int = 128      # each routed expert's intermediate width
    shared_inter: int = 256      # the shared expert's
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_positions: int = 4096

    def validate(self):
        if self.hidden % 16:
            raise ValueError(f"hidden {self.hidden} is not a multiple of 16")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads} query heads do not group over {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError("RoPE needs an even head_dim")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} of {self.experts} experts")


def make_weights(config, seed):
    """Random weights, float32, reproducible from the seed (the scale keeps activations O(1))."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def normal(*shape, fan_in):
        return (torch.randn(*shape, generator=g, dtype=F64) / math.sqrt(fan_in)).to(F32)

    def norm_weight(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g, dtype=F64)).to(F32)

    w = {"embed": normal(c.vocab, c.hidden, fan_in=1), "final_norm": norm_weight(c.hidden),
         "lm_head": normal(c.hidden, c.vocab, fan_in=c.hidden)}
    for l in range(c.layers):
        p = f"layers.{l}."
        w[p + "attn_norm"] = norm_weight(c.hidden)
        w[p + "wq"] = normal(c.hidden, c.q_heads * c.head_dim, fan_in=c.hidden)
        w[p + "wk"] = normal(c.hidden, c.kv_heads * c.head_dim, fan_in=c.hidden)
        w[p + "wv"] = normal(c.hidden, c.kv_heads * c.head_dim, fan_in=c.hidden)
        w[p + "wo"] = normal(c.q_heads * c.head_dim, c.hidden, fan_in=c.q_heads * c.head_dim)
        w[p + "ffn_norm"] = norm_weight(c.hidden)
        w[p + "router"] = normal(c.hidden, c.experts, fan_in=c.hidden)
        w[p + "experts.gate"] = normal(c.experts, c.hidden, c.expert_inter, fan_in=c.hidden)
        w[p + "experts.up"] = normal(c.experts, c.hidden, c.expert_inter, fan_in=c.hidden)
        w[p + "experts.down"] = normal(c.experts, c.expert_inter, c.hidden, fan_in=c.expert_inter)
        w[p + "shared.gate"] = normal(c.hidden, c.shared_inter, fan_in=c.hidden)
        w[p + "shared.up"] = normal(c.hidden, c.shared_inter, fan_in=c.hidden)
        w[p + "shared.down"] = normal(c.shared_inter, c.hidden, fan_in=c.shared_inter)
    return w


def expected_shapes(config):
    c = config
    shapes = {"embed": (c.vocab, c.hidden), "final_norm": (c.hidden,),
              "lm_head": (c.hidden, c.vocab)}
    for l in range(c.layers):
        p = f"layers.{l}."
        shapes.update({
            p + "attn_norm": (c.hidden,), p + "wq": (c.hidden, c.q_heads * c.head_dim),
            p + "wk": (c.hidden, c.kv_heads * c.head_dim),
            p + "wv": (c.hidden, c.kv_heads * c.head_dim),
            p + "wo": (c.q_heads * c.head_dim, c.hidden), p + "ffn_norm": (c.hidden,),
            p + "router": (c.hidden, c.experts),
            p + "experts.gate": (c.experts, c.hidden, c.expert_inter),
            p + "experts.up": (c.experts, c.hidden, c.expert_inter),
            p + "experts.down": (c.experts, c.expert_inter, c.hidden),
            p + "shared.gate": (c.hidden, c.shared_inter),
            p + "shared.up": (c.hidden, c.shared_inter),
            p + "shared.down": (c.shared_inter, c.hidden)})
    return shapes


_DTYPES = {"F32": F32, "F64": F64, "BF16": BF16, "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save(path, config, weights):
    """The safetensors format (an 8-byte little-endian header length, a JSON header naming each
    tensor's dtype, shape and byte range, then the bytes), written here so that no pickle is
    involved and any safetensors reader takes the file; the config goes in its metadata."""
    header, offset, blobs = {"__metadata__": {"config": json.dumps(dataclasses.asdict(config))}}, \
        0, []
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        raw = (t.view(torch.int16) if t.dtype == BF16 else t).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(raw)


def _read(path):
    """(metadata, tensors) of a safetensors file, every range checked against the file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a model file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > 100 << 20:
        raise ValueError(f"{path}: not a model file (header of {n} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a model file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a model file (header is not an object)")
    meta, body, tensors = header.pop("__metadata__", {}), data[8 + n:], {}
    for name, spec in header.items():
        try:
            dtype, shape, (lo, hi) = _DTYPES[spec["dtype"]], spec["shape"], spec["data_offsets"]
            numel = math.prod(shape)
            item = torch.tensor([], dtype=dtype).element_size()
            ok = 0 <= lo <= hi <= len(body) and hi - lo == numel * item
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: tensor {name}: bad entry {spec}")
        raw = torch.frombuffer(bytearray(body[lo:hi]), dtype=torch.int16 if dtype == BF16
                               else dtype) if hi > lo else torch.zeros(0, dtype=dtype)
        tensors[name] = (raw.view(BF16) if dtype == BF16 else raw).reshape(shape)
    return meta, tensors


def load(path):
    """(config, weights) from a file `save` wrote (or any safetensors file holding these
    tensors). Every tensor is checked against the config's shapes: a missing, extra or
    misshapen tensor is a ValueError naming it."""
    meta, weights = _read(path)
    try:
        config = Config(**json.loads(meta["config"]))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: bad config metadata ({e})") from None
    config.validate()
    want = expected_shapes(config)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ValueError(f"{path}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in want.items():
        t = weights[name]
        if tuple(t.shape) != shape or t.dtype != F32:
            raise ValueError(f"{path}: {name} is {t.dtype} {tuple(t.shape)}, want float32 {shape}")
    return config, weights


def load_or_make(path, config=Config(), seed=0):
    """The model at `path`, written there first from `seed` if the file does not exist."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        save(tmp, config, make_weights(config, seed))
        os.replace(tmp, path)
    return load(path)


# ---- the cache ----------------------------------------------------------------------------------

def cache_shape(config, num_pages, kv_heads_local):
    """One rank's paged cache: [layers, pages, 2 (K, V), kv heads, page tokens, head_dim] float32;
    each page's heads are contiguous token rows (HND), so a head-shard of a page is one range."""
    return (config.layers, num_pages, 2, kv_heads_local, config.page_tokens, config.head_dim)


def pages_for(config, num_tokens):
    return -(-num_tokens // config.page_tokens)


class PagePool:
    """Free page ids of one cache, handed out lowest first."""

    def __init__(self, num_pages):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self):
        return len(self._free)

    def take(self, n):
        """n page ids, or None when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def give(self, pages):
        self._free.extend(reversed(pages))


@dataclasses.dataclass
class Seq:
    """One sequence's part of a forward pass: `num_new` tokens starting at position `start`,
    its cache pages (page i holds positions [i * page_tokens, (i + 1) * page_tokens))."""
    pages: list
    start: int
    num_new: int


# ---- the model ----------------------------------------------------------------------------------

def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _silu_mlp(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


class Model:
    """The model's computation, for the attention heads of one tensor-parallel rank.

    tp_rank / tp_size: which share of the query and KV heads this rank's attention holds (its
    wq / wk / wv columns and wo rows); layer() returns that share's partial output projection,
    which the caller sums over ranks. Everything else is whole on every rank. Inputs and outputs
    are float64 [tokens, hidden] on `device`.
    """

    def __init__(self, config, weights, tp_rank=0, tp_size=1, device="cpu"):
        config.validate()
        if config.kv_heads % tp_size:
            raise ValueError(f"{config.kv_heads} KV heads do not split over {tp_size} ranks")
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        c = config
        self.kv_local = c.kv_heads // tp_size
        self.q_local = c.q_heads // tp_size
        q = slice(tp_rank * self.q_local * c.head_dim, (tp_rank + 1) * self.q_local * c.head_dim)
        kv = slice(tp_rank * self.kv_local * c.head_dim,
                   (tp_rank + 1) * self.kv_local * c.head_dim)

        def w(name):
            return weights[name].to(device=device, dtype=F64)

        self.embed_w, self.final_norm, self.lm_head = w("embed"), w("final_norm"), w("lm_head")
        self.layers = []
        for l in range(c.layers):
            p = f"layers.{l}."
            self.layers.append({
                "attn_norm": w(p + "attn_norm"), "wq": w(p + "wq")[:, q].contiguous(),
                "wk": w(p + "wk")[:, kv].contiguous(), "wv": w(p + "wv")[:, kv].contiguous(),
                "wo": w(p + "wo")[q, :].contiguous(), "ffn_norm": w(p + "ffn_norm"),
                "router": w(p + "router"), "gate": w(p + "experts.gate"),
                "up": w(p + "experts.up"), "down": w(p + "experts.down"),
                "shared_gate": w(p + "shared.gate"), "shared_up": w(p + "shared.up"),
                "shared_down": w(p + "shared.down")})
        half = c.head_dim // 2
        freqs = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=F64, device=device) / half))
        angles = torch.arange(c.max_positions, dtype=F64, device=device)[:, None] * freqs
        self.cos, self.sin = angles.cos(), angles.sin()
        self.device = device

    # -- attention --

    def _rope(self, x, positions):  # x [T, heads, head_dim]
        half = self.config.head_dim // 2
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def attention(self, l, x, seqs, cache):
        """This rank's heads of layer l for the rows of `seqs` (concatenated in x): appends their
        K and V to the cache (cache[l], float32), attends causally over each sequence's cache,
        and returns this rank's partial output projection [T, hidden] (sum it over TP ranks)."""
        c, w = self.config, self.layers[l]
        if not seqs:
            return torch.zeros(0, c.hidden, dtype=F64, device=self.device)
        xn = _rms_norm(x, w["attn_norm"], c.norm_eps)
        positions = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in seqs]).to(
            self.device)
        q = self._rope((xn @ w["wq"]).view(-1, self.q_local, c.head_dim), positions)
        k = self._rope((xn @ w["wk"]).view(-1, self.kv_local, c.head_dim), positions)
        v = (xn @ w["wv"]).view(-1, self.kv_local, c.head_dim)
        layer_cache = cache[l]
        outs, row = [], 0
        group = self.q_local // self.kv_local
        for s in seqs:
            rows = slice(row, row + s.num_new)
            pages = torch.tensor(s.pages, device=self.device)
            pos = torch.arange(s.start, s.start + s.num_new, device=self.device)
            page, slot = pages[pos // c.page_tokens], pos % c.page_tokens
            layer_cache[page, 0, :, slot] = k[rows].to(F32)
            layer_cache[page, 1, :, slot] = v[rows].to(F32)
            length = s.start + s.num_new
            used = pages[:pages_for(c, length)]
            # [kv heads, tokens, head_dim] of the whole sequence so far
            keys = layer_cache[used, 0].permute(1, 0, 2, 3).reshape(
                self.kv_local, -1, c.head_dim)[:, :length].to(F64)
            values = layer_cache[used, 1].permute(1, 0, 2, 3).reshape(
                self.kv_local, -1, c.head_dim)[:, :length].to(F64)
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
            qs = q[rows].transpose(0, 1)  # [q heads, new, head_dim]
            scores = qs @ keys.transpose(1, 2) / math.sqrt(c.head_dim)
            mask = torch.arange(length, device=self.device)[None, :] > pos[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            outs.append((scores.softmax(-1) @ values).transpose(0, 1).reshape(s.num_new, -1))
            row += s.num_new
        return torch.cat(outs) @ w["wo"]

    def attention_static(self, l, x, positions, table, cache):
        """attention() for one new token per row in shapes fixed ahead (what a CUDA graph
        replays): positions [B] and table [B, W] (each row's page ids, padded) are device
        tensors. A row attends over W pages with the positions past its own masked out, which
        adds exact zeros to its softmax; padding rows should point at a page kept for them."""
        c, w = self.config, self.layers[l]
        rows = x.shape[0]
        xn = _rms_norm(x, w["attn_norm"], c.norm_eps)
        q = self._rope((xn @ w["wq"]).view(rows, self.q_local, c.head_dim), positions)
        k = self._rope((xn @ w["wk"]).view(rows, self.kv_local, c.head_dim), positions)
        v = (xn @ w["wv"]).view(rows, self.kv_local, c.head_dim)
        layer_cache = cache[l]
        page = table.gather(1, (positions // c.page_tokens)[:, None]).squeeze(1)
        slot = positions % c.page_tokens
        layer_cache[page, 0, :, slot] = k.to(F32)
        layer_cache[page, 1, :, slot] = v.to(F32)
        span = table.shape[1] * c.page_tokens
        group = self.q_local // self.kv_local

        def gathered(component):  # [B, q heads, span, head_dim]
            t = layer_cache[table, component].permute(0, 2, 1, 3, 4)
            return t.reshape(rows, self.kv_local, span, c.head_dim).to(F64).repeat_interleave(
                group, dim=1)

        scores = (q[:, :, None, :] @ gathered(0).transpose(2, 3)).squeeze(2) / math.sqrt(
            c.head_dim)
        mask = torch.arange(span, device=x.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        out = (scores.softmax(-1)[:, :, None, :] @ gathered(1)).squeeze(2)
        return out.reshape(rows, -1) @ w["wo"]

    # -- the MoE FFN --

    def route(self, l, h):
        """(normed input [T, hidden] float64, expert ids [T, top_k] int64 ascending, their
        weights [T, top_k] float32): the top_k experts by router score, softmax over those."""
        c, w = self.config, self.layers[l]
        xn = _rms_norm(h, w["ffn_norm"], c.norm_eps)
        scores, ids = (xn @ w["router"]).topk(c.top_k, dim=-1)
        weights = scores.softmax(-1)
        ids, order = ids.sort(dim=-1)
        return xn, ids, weights.gather(-1, order).to(F32)

    def expert(self, l, e, x_bf16):
        """Routed expert e of layer l on bf16 rows: bf16 rows."""
        w = self.layers[l]
        x = x_bf16.to(F64)
        return _silu_mlp(x, w["gate"][e], w["up"][e], w["down"][e]).to(BF16)

    def shared_expert(self, l, xn):
        w = self.layers[l]
        return _silu_mlp(xn, w["shared_gate"], w["shared_up"], w["shared_down"])

    @staticmethod
    def combine(outputs, weights):
        """outputs [T, top_k, hidden] bf16 (in the order of route's ids), weights [T, top_k]
        float32: sum of weight x output in float32, one expert after the other, then bf16 --
        the sum ferry's AllToAll forms, term for term."""
        acc = torch.zeros(outputs.shape[0], outputs.shape[2], dtype=F32, device=outputs.device)
        for j in range(outputs.shape[1]):
            acc = acc + weights[:, j:j + 1] * outputs[:, j].to(F32)
        return acc.to(BF16)

    def local_moe(self, l, xn, ids, weights, experts=None):
        """The routed experts of layer l computed here: combine()'s result [T, hidden] bf16.
        experts: the expert ids this process computes (all by default); the others' outputs
        are left zero, for the caller to sum over the processes that hold them."""
        x = xn.to(BF16)
        outputs = torch.zeros(x.shape[0], self.config.top_k, x.shape[1], dtype=BF16,
                              device=x.device)
        for e in range(self.config.experts) if experts is None else experts:
            token, j = (ids == e).nonzero(as_tuple=True)
            if len(token):
                outputs[token, j] = self.expert(l, e, x[token])
        return outputs

    # -- the whole --

    def embed(self, tokens):
        if isinstance(tokens, torch.Tensor):
            return self.embed_w[tokens]
        return self.embed_w[torch.as_tensor(tokens, dtype=torch.long, device=self.device)]

    def final_hidden(self, h):
        return _rms_norm(h, self.final_norm, self.config.norm_eps)

    def logits(self, hidden):
        return hidden @ self.lm_head

    def forward(self, tokens, seqs, cache, all_reduce=lambda t: t, moe=None,
                after_attention=None, attend=None):
        """Every layer over the rows of `seqs` (tokens: their ids, concatenated): the final
        hidden states [T, hidden] float64.

        all_reduce(t): the sum of t over this rank's TP group (identity at TP 1);
        moe(l, xn, ids, weights, shared): the routed experts' combined output [T, hidden] bf16
        (local_moe + combine by default), where shared() computes the shared expert between
        the send and receive halves; after_attention(l): called once layer l's output
        projection is summed (its K and V are in the cache then); attend(l, h): the attention
        to use instead of attention(l, h, seqs, cache) (attention_static's).
        """
        h = self.embed(tokens)
        for l in range(self.config.layers):
            part = attend(l, h) if attend is not None else self.attention(l, h, seqs, cache)
            h = h + all_reduce(part)
            if after_attention is not None:
                after_attention(l)
            xn, ids, weights = self.route(l, h)
            if moe is None:
                routed = self.combine(self.local_moe(l, xn, ids, weights), weights)
                shared = self.shared_expert(l, xn)
            else:
                box = []
                routed = moe(l, xn, ids, weights, lambda: box.append(self.shared_expert(l, xn)))
                shared = box[0] if box else self.shared_expert(l, xn)
            h = h + shared + routed.to(F64)
        return self.final_hidden(h)


def generate(model, prompt, max_new_tokens, num_pages=None):
    """The colocated reference: one process, plain torch. Prefills the prompt but its last token,
    then decodes greedily from the last token: the generated token ids. The aux hidden state
    (the final hidden state at the token before the last) comes back too, as a float32 tensor
    [hidden] (None for a one-token prompt)."""
    c = model.config
    total = len(prompt) + max_new_tokens
    pages = list(range(num_pages or pages_for(c, total)))
    cache = torch.zeros(cache_shape(c, len(pages), model.kv_local), dtype=F32,
                        device=model.device)
    aux = None
    if len(prompt) > 1:
        hidden = model.forward(prompt[:-1], [Seq(pages, 0, len(prompt) - 1)], cache)
        aux = hidden[-1].to(F32)
    out, token = [], prompt[-1]
    for i in range(max_new_tokens):
        hidden = model.forward([token], [Seq(pages, len(prompt) - 1 + i, 1)], cache)
        token = int(model.logits(hidden[-1]).argmax())
        out.append(token)
    return out, aux
