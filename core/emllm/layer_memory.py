"""One layer's tensors of an episodic memory: its local window, its sinks, its event representatives and the KV it
holds in attention for the current forward.

EpisodicMemory (memory.py) owns one LayerMemory per decoder layer and decides, for all of them at once, what is read,
evicted and kept; a LayerMemory only holds and transforms tensors (rotating the window, scoring what each token
received, picking representatives, loading retrieved KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .attention import on_device, received_by_steps
from .config import EMConfig
from .retrieval import ContiguityBuffer, RepresentativeIndex
from .rope import RotaryTable
from .scoring import representative_search, uses_stored_keys
from .storage import PageStore


DEFERRED_STEPS = 64
"""Decoding steps whose attention received is summed in one pass over the window (LayerMemory.defer_received)."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_positions: int


class LayerMemory:
    """The tensors of one layer: local window (raw and rotated keys), sinks, representatives, retrieved KV."""

    def __init__(self, layer_index: int, config: EMConfig, shape: ModelShape, device: torch.device,
                 rope: RotaryTable):
        self.layer_index = layer_index
        self.config, self.shape, self.device, self.rope = config, shape, device, rope
        kv, d = shape.num_kv_heads, shape.head_dim
        capacity = config.max_position() if config.attention == "episodic" else config.chunk_size
        # An episodic window is allocated at its layout's size and grows only while an input is read in full
        # attention (EMConfig.full_until), up to this many tokens; full attention grows without bound.
        self.most_tokens = config.window_capacity(shape.max_positions) if config.attention == "episodic" else None
        self.keys = torch.empty(kv, capacity, d, dtype=shape.dtype, device=device)        # [kv, cap, d] raw
        self.values = torch.empty_like(self.keys)                                         # [kv, cap, d]
        self.rotated = torch.empty_like(self.keys)        # keys rotated at their window position
        self._received = torch.zeros(kv, capacity, dtype=torch.float32, device=device)    # attention received
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # decoding steps not yet in _received
        self._deferred_scaling = 1.0
        self.length = 0            # tokens in the window
        self.rotated_length = 0    # prefix of `rotated` that is valid for the current window start
        self.sink_keys = torch.empty(kv, 0, d, dtype=shape.dtype, device=device)  # rotated at position 0
        self.sink_values = torch.empty(kv, 0, d, dtype=shape.dtype, device=device)
        self.index = RepresentativeIndex(kv * d, device, *representative_search(config.scorer))
        self.contiguity = ContiguityBuffer(config.contiguity_tokens, config.contiguity_neighbours)
        self.retrieved_ids: tuple[int, ...] = ()
        self.memory_keys = self.sink_keys      # [kv, m, d] sinks + retrieved events, rotated at position 0
        self.memory_values = self.sink_values
        self.ordered_keys = self.sink_keys     # memory_keys rotated at 0..m-1, for memory_positions="ordered"
        self._ordered_source = self.sink_keys  # the memory_keys tensor that ordered_keys was rotated from
        self.retrievals = 0
        self.answer_mass: torch.Tensor | None = None  # [e] attention the answer's queries gave each event so far
        # What the last answering retrieval depended on, under a scorer that reads no queries (scoring.query_free):
        # the same key gives the same events, so the retrieval is not run again (forward.retrieve).
        self.fixed_retrieval: tuple | None = None
        # A scorer reading every stored key, with no memory budget, keeps a float32 copy of them (stored_keys).
        self.keeps_key_copy = (uses_stored_keys(config.scorer) and config.ram_budget_mb is None
                               and config.device_budget_mb is None)
        self.key_copy = torch.empty(kv, 0, d, dtype=torch.float32, device=device)  # [kv, capacity, d]
        self.key_copy_length = 0   # stored tokens copied so far
        self.key_copy_owned = True  # False after a fork: the buffer is shared, so copy before writing

    # ------------------------------------------------------------------ local window
    def append(self, keys: torch.Tensor, values: torch.Tensor, rotated: torch.Tensor | None = None) -> None:
        """keys, values: [kv, q, d] of the tokens being read (un-rotated). ``rotated``: the same keys already rotated
        at their window positions (a decoding step rotates every conversation's new key in one op), kept where the
        window before them is rotated too; otherwise window_keys rotates them when they are read."""
        q = keys.shape[1]
        if self.length + q > self.keys.shape[1]:
            if self.most_tokens is not None and self.length + q > self.most_tokens:
                raise RuntimeError("local window overflow: evict() was not called between forward passes")
            self._resize(min(max(2 * self.keys.shape[1], self.length + q), self.most_tokens or self.length + q))
        self.keys[:, self.length:self.length + q] = keys
        self.values[:, self.length:self.length + q] = values
        self._received[:, self.length:self.length + q] = 0  # not .scores: a deferred step never sees later keys
        if rotated is not None and self.rotated_length == self.length:
            self.rotated[:, self.length:self.length + q] = rotated
            self.rotated_length += q
        self.length += q

    @property
    def scores(self) -> torch.Tensor:
        """[kv, capacity] the attention each window token has received (float32), deferred decoding steps included:
        what picks an event's representative tokens when it leaves the window."""
        self.flush_received()
        return self._received

    def defer_received(self, query: torch.Tensor, lse: torch.Tensor, scaling: float) -> None:
        """Count a decoding step's attention (query [1, heads, 1, d] rotated at its window position, lse
        [1, heads, 1]) into the scores later, with other steps': one read of the window for many steps (the
        scores are only read when events are cut, saved or forked)."""
        self._deferred.append((query[0, :, 0], lse[0, :, 0], self.length))
        self._deferred_scaling = scaling
        if len(self._deferred) >= DEFERRED_STEPS:
            self.flush_received()

    @property
    def pending_steps(self) -> int:
        """Decoding steps whose attention to the window is recorded but not yet added to the token scores (they are
        scored together, DEFERRED_STEPS at a time or when the window is cut into events)."""
        return len(self._deferred)

    def flush_received(self) -> None:
        """Add the deferred decoding steps' attention to the scores; before any token leaves the window, since each
        step's query was rotated for the window it saw."""
        if not self._deferred:
            return
        queries, lse, visible = zip(*self._deferred)
        self._deferred = []
        width = max(visible)  # no token has left the window since (drop_oldest reads .scores first)
        self._received[:, :width] += received_by_steps(torch.stack(queries), self.window_keys()[:, :width],
                                                       torch.stack(lse), on_device(list(visible), self.device),
                                                       self._deferred_scaling)

    def fit_capacity(self) -> None:
        """Give back the room a full-attention start grew the window to, once it holds the layout's tokens again."""
        layout = self.config.max_position()
        if self.config.attention == "episodic" and self.keys.shape[1] > layout >= self.length:
            self._resize(layout)

    def compact(self) -> None:
        """Hold no room beyond the window's tokens: for a memory that will only be forked or saved (a pool's
        checkpoint; a fork allocates its own room). A window holds up to 40% of its layout at rest, so the room
        was about 40 MB of SmolLM2's per checkpoint; reading on grows it again."""
        if self.keys.shape[1] > self.length:
            self._resize(self.length)

    def _resize(self, capacity: int) -> None:
        """Reallocate the window's buffers to hold ``capacity`` tokens, keeping the ones it holds. Made as ordinary
        tensors even inside a forward's inference mode: a fork or a save writes into them later, outside it."""
        self.flush_received()
        self.rope.ensure(capacity)
        with torch.inference_mode(False):
            for name in ("keys", "values", "rotated"):
                old = getattr(self, name)
                new = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
            scores = torch.zeros(self._received.shape[0], capacity, dtype=torch.float32, device=self.device)
            scores[:, : self.length] = self._received[:, : self.length]
            self._received = scores

    def window_keys(self) -> torch.Tensor:
        """[kv, length, d] keys rotated at their position in the window; only new tokens are rotated."""
        if self.rotated_length < self.length:
            positions = torch.arange(self.rotated_length, self.length, device=self.device)
            self.rotated[:, self.rotated_length:self.length] = self.rope.rotate(
                self.keys[:, self.rotated_length:self.length], positions)
            self.rotated_length = self.length
        return self.rotated[:, : self.length]

    def window_values(self) -> torch.Tensor:
        return self.values[:, : self.length]

    def drop_oldest(self, n: int) -> None:
        """Remove the n oldest window tokens; the rest move to the front and must be re-rotated."""
        keep = self.length - n
        for buffer in (self.keys, self.values, self.scores):
            buffer[:, :keep] = buffer[:, n:self.length].clone()
        self.length = keep
        self.rotated_length = 0

    # ------------------------------------------------------------------ memory part
    def set_sinks(self, n: int) -> None:
        """The first n window tokens become attention sinks at the fixed memory position."""
        positions = torch.zeros(n, dtype=torch.long, device=self.device)
        self.sink_keys = self.rope.rotate(self.keys[:, :n], positions).clone()
        self.sink_values = self.values[:, :n].clone()
        self.memory_keys, self.memory_values = self.sink_keys, self.sink_values
        self.drop_oldest(n)

    def ordered_memory_keys(self) -> torch.Tensor:
        """[kv, m, d] the memory part's keys rotated at positions 0..m-1 (memory_positions="ordered"): sinks, then
        retrieved tokens in input order. Rotated once per change of the retrieved set, not per step."""
        if self._ordered_source is not self.memory_keys:
            m = self.memory_keys.shape[1]
            self.ordered_keys = self.rope.rotate(self.memory_keys, torch.arange(m, device=self.device))
            self._ordered_source = self.memory_keys
        return self.ordered_keys

    def add_events(self, starts: torch.Tensor, sizes: torch.Tensor, topk: int) -> torch.Tensor:
        """Representatives of events covering window[0, sum(sizes)); returns their KV rotated at position 0.

        starts, sizes: [e] window-relative. Returns [2, n, kv, d] for storage (n = sum(sizes)).
        """
        n = int(sizes.sum())
        keys = self.rope.rotate(self.keys[:, :n], torch.zeros(n, dtype=torch.long, device=self.device))
        # The longest event is read here, on the CPU: read from the device copy it would wait for the GPU.
        self.index.add(event_representatives(keys, self.scores[:, :n], starts.to(self.device, non_blocking=True),
                                             sizes.to(self.device, non_blocking=True), topk, int(sizes.max())))
        return torch.stack([keys, self.values[:, :n]]).transpose(1, 2)  # [2, n, kv, d]

    def set_retrieved(self, event_ids: tuple[int, ...], keys: torch.Tensor | None = None,
                      values: torch.Tensor | None = None) -> None:
        """Hold these events in attention after the sinks: keys, values [kv, n, d] rotated at position 0."""
        self.retrieved_ids = event_ids
        if not event_ids:
            self.memory_keys, self.memory_values = self.sink_keys, self.sink_values
            return
        if keys is None or values is None:
            raise ValueError("set_retrieved needs the events' keys and values when it is given events to hold.")
        self.memory_keys = torch.cat([self.sink_keys, keys], dim=1)
        self.memory_values = torch.cat([self.sink_values, values], dim=1)

    def add_to_answer(self, mass: torch.Tensor) -> torch.Tensor:
        """[e] this forward's attention mass plus what the answer's earlier forwards gave each event (the
        question's among them). Events stored since then (evicted while answering) start from this forward's."""
        total = mass.clone()
        if self.answer_mass is not None:
            total[:self.answer_mass.shape[0]] += self.answer_mass.to(total.device)
        self.answer_mass = total
        return total

    def stored_keys(self, store: PageStore) -> torch.Tensor:
        """Every stored key of this layer, [kv, n, d]. Read from the store's pages, attention scoring would gather,
        concatenate and convert all of them at every retrieval, i.e. at every decoded token; with the copy only
        the keys stored since the last retrieval are read. The copy costs as many bytes as the stored KV, so with
        a RAM or device budget (memory meant to stay bounded) the pages are read each time instead."""
        if not self.keeps_key_copy:
            return store.layer_keys(self.layer_index, self.device)
        n, copied = store.num_tokens, self.key_copy_length
        if n > copied:
            new = store.layer_keys(self.layer_index, self.device, start=copied)              # [kv, n - copied, d]
            if n > self.key_copy.shape[1] or not self.key_copy_owned:
                kv, capacity, d = self.key_copy.shape
                grown = torch.empty(kv, max(n, 2 * capacity), d, dtype=torch.float32, device=self.device)
                grown[:, :copied] = self.key_copy[:, :copied]
                self.key_copy, self.key_copy_owned = grown, True
            self.key_copy[:, copied:n] = new
            self.key_copy_length = n
        return self.key_copy[:, :n]

    def share_key_copy(self, other: LayerMemory) -> None:
        """Use other's key copy (a fork's parent): the parent only writes past its own length, which this layer
        never reads, and this layer copies the buffer before it writes (key_copy_owned)."""
        self.key_copy, self.key_copy_length, self.key_copy_owned = other.key_copy, other.key_copy_length, False

    # ------------------------------------------------------------------ state
    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (views included: memory.held_bytes counts each storage once, whole)."""
        return [*(v for v in vars(self).values() if isinstance(v, torch.Tensor)), self.index.vectors]

    def state_dict(self) -> dict[str, Any]:
        """This layer's state outside the page store (tensors by reference: load_state_dict copies what it keeps)."""
        return {
            "window_keys": self.keys[:, :self.length], "window_values": self.values[:, :self.length],
            "window_rotated": self.rotated[:, :self.rotated_length], "window_scores": self.scores[:, :self.length],
            "sink_keys": self.sink_keys, "sink_values": self.sink_values,
            "representatives": self.index.vectors,
            "contiguity": self.contiguity.entries(), "retrieved_ids": list(self.retrieved_ids),
            "retrievals": self.retrievals,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state_dict() (of a fresh layer's shape): windows and index are copied; sinks are shared, being
        only ever replaced, never written in place. The retrieved events' KV is loaded by the caller."""
        device = self.device
        self.length = self.rotated_length = 0
        self.append(state["window_keys"].to(device), state["window_values"].to(device))  # grows if needed
        self.scores[:, :self.length] = state["window_scores"].to(device)
        rotated = state["window_rotated"].shape[1]
        self.rotated[:, :rotated] = state["window_rotated"].to(device)
        self.rotated_length = rotated
        self.sink_keys, self.sink_values = state["sink_keys"].to(device), state["sink_values"].to(device)
        self.memory_keys, self.memory_values = self.sink_keys, self.sink_values
        if state["representatives"].shape[0]:
            self.index.add(state["representatives"])
        self.contiguity.load(state["contiguity"])
        self.retrieved_ids = tuple(state["retrieved_ids"])
        self.retrievals = int(state["retrievals"])


def event_representatives(keys: torch.Tensor, scores: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
                          topk: int, longest: int | None = None) -> torch.Tensor:
    """Per event and KV head, the mean key of the topk most-attended tokens: [e, kv * d] float32.

    keys [kv, n, d], scores [kv, n]; events are the contiguous ranges (starts, sizes). Events are padded to the
    longest one so all are handled in one topk, padding scored -inf and excluded from the mean. ``longest``: the
    largest size where the caller knows it (sizes on a GPU would otherwise be read back to find it).
    """
    kv, _, d = keys.shape
    e, longest = starts.shape[0], int(sizes.max()) if longest is None else longest
    offsets = torch.arange(longest, device=keys.device)                       # [longest]
    token = starts[:, None] + offsets[None, :]                                # [e, longest]
    valid = offsets[None, :] < sizes[:, None]                                 # [e, longest]
    token = torch.where(valid, token, torch.zeros_like(token))
    padded = scores[:, token].masked_fill(~valid[None], float("-inf"))        # [kv, e, longest]
    k = min(topk, longest)
    top_scores, top = padded.topk(k, dim=-1)                                  # [kv, e, k]
    chosen = torch.gather(token[None].expand(kv, -1, -1), 2, top)             # [kv, e, k] token ids
    weight = torch.isfinite(top_scores).to(torch.float32)                     # [kv, e, k]
    picked = keys.float()[torch.arange(kv, device=keys.device)[:, None, None], chosen]  # [kv, e, k, d]
    mean = (picked * weight[..., None]).sum(2) / weight.sum(2).clamp_min(1)[..., None]  # [kv, e, d]
    return mean.transpose(0, 1).reshape(e, kv * d)
