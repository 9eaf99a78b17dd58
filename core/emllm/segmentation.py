"""Event segmentation: surprise boundaries (EM-LLM Eq. 1) and graph refinement (Alg. 1, Eq. 3/4).

Pure functions on torch tensors. They know nothing of models, layers or caches: the engine hands in
logits, surprise values, keys and boundary positions, and gets positions back. Every function works
on whatever device its inputs live on.

Conventions and the decisions behind them:

- A *boundary* is an event start. Boundaries are sorted, unique positions in (0, n): event 0 always
  starts at 0 and the last event ends at n, so neither 0 nor n is ever listed.
- The boundary goes *at* the surprising token: token t with a high -log p(x_t | x_<t) opens the new
  event. The surprise is the model failing to predict x_t from the old context, so x_t is the first
  token of the new one (the reference implementation stores the value at t-1, an off-by-one).
- Threshold (Eq. 1): T_t = mu + gamma * sigma over the tau stream positions before t (population std).
  The statistics use float64 cumulative sums, so a whole chunk is thresholded in one expression, and
  a stream processed in pieces gives the same flags as the whole stream (up to float64 rounding when
  a value sits exactly on its threshold). Non-finite surprise values
  are "absent": the first token of a text has none (NaN), and one +inf would poison every later window
  sum, so neither enters mu/sigma; a NaN token is never flagged, a +inf one is (it is maximally
  surprising).
- Event sizes: too-short events merge forward into the next one, too-long ones are cut every
  max_size tokens. When a cut would leave a closed event shorter than min_size, the last cut moves
  back so that tail is exactly min_size (see `enforce_event_sizes`).
- Similarity graph (Eq. 2): dot products of keys, averaged over heads/layers, with negative entries
  clamped to 0. Modularity and conductance are defined for non-negative edge weights: with negative
  weights degrees and volumes can be 0 or negative, and the metrics stop meaning "dense inside, sparse
  across". A negative dot product says "unrelated", which is what a missing edge says.
- Refinement window: the paper's Alg. 1 searches beta_hat in (alpha, beta], i.e. a boundary may only
  move earlier. We search the open interval (alpha, gamma) between the refined previous boundary and
  the next original one, so a boundary can move either way: the surprising token can come late
  (the topic changed a few tokens before the model noticed) or early (a surprising token inside the
  old topic, just before the real change). The first boundary is refined too (alpha = 0) and the last
  one may move up to n - 1. Ties keep the candidate closest to the original boundary, so a boundary
  never moves without a strict gain in the metric. Refinement does not look at event sizes: a refined
  event can be shorter than min_size (the caller decides where `enforce_event_sizes` goes).
- Refinement cost: a 2-D prefix sum (integral image, float64) of the adjacency is built once, O(n^2);
  after that each candidate split costs O(1) and all candidates of one boundary are scored in one
  vectorised expression. The loop is over boundaries only, because Alg. 1 is sequential: each window
  starts at the previous boundary *after* its refinement. That loop runs on the host in numpy (tiny
  arrays, where per-op dispatch dominates); inputs and outputs are torch tensors on any device.
"""

from typing import Literal

import numpy as np
import torch
from torch import Tensor

# Relative scale below which float64 prefix-sum differences are rounding noise (snapped to 0), and the
# tolerance under which two metric values count as a tie (so noise never moves a boundary).
_SNAP_RTOL = 1e-12
_TIE_RTOL = 1e-9
# Largest fp32 slice token_surprise works on (4 MB): small enough to stay in L2/L3 cache.
_SLICE_ELEMENTS = 1 << 20


# -----------------------------------------------------------------------------
# surprise (Eq. 1)

def token_surprise(logits: Tensor, next_ids: Tensor, rows_per_slice: int = 64) -> Tensor:
    """-log p(next_ids[i] | logits[i]) as float32 [n], computed in row slices.

    logits [n, V] in any float dtype (bf16 from the forward pass is typical), next_ids [n] the tokens
    those logits predict. Slicing bounds the fp32 working copy: with V = 150K a full fp32 [512, V]
    copy would be 300 MB for 512 numbers. A slice holds at most rows_per_slice rows and at most
    _SLICE_ELEMENTS values: the cap keeps the working set in cache, which matters more than the row
    count (on this project's CPU, V = 152K: 64-row slices of 39 MB took 4x longer than 6-row ones).
    log_softmax + gather is used rather than logsumexp - logit: the same numbers, and torch's fused
    log_softmax kernel measured 2x faster than its logsumexp on CPU, for one more [rows, V] buffer.
    """
    if logits.dim() != 2 or next_ids.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [n, V] and next_ids [n], "
                         f"got {tuple(logits.shape)} and {tuple(next_ids.shape)}")
    if rows_per_slice < 1:
        raise ValueError(f"rows_per_slice must be >= 1, got {rows_per_slice}")
    n, vocab = logits.shape
    rows = max(1, min(rows_per_slice, _SLICE_ELEMENTS // max(vocab, 1)))
    ids = next_ids.to(device=logits.device, dtype=torch.long)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)  # [n]
    for start in range(0, n, rows):  # loop over slices of rows, not tokens
        logp = torch.log_softmax(logits[start:start + rows].float(), dim=1)  # [r, V] fp32
        out[start:start + rows] = -logp.gather(1, ids[start:start + rows, None]).squeeze(1)
    return out


def surprise_boundary_flags(previous: Tensor, new: Tensor, gamma: float, tau: int, min_history: int = 8) -> Tensor:
    """bool [n]: new[i] > mu_i + gamma * sigma_i over the tau stream positions before new[i].

    The stream is cat(previous, new); only previous[-tau:] can reach a window, so the caller may pass
    its whole history or just the tail. Non-finite values in a window are left out of mu/sigma (and
    out of the count). With fewer than min_history values in the window the threshold is too noisy to
    trust, so the flag is False. A NaN token is never flagged.
    """
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    if min_history > tau:
        raise ValueError(f"min_history ({min_history}) > tau ({tau}) would never flag any token")
    if new.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=new.device)
    prev = previous.reshape(-1)[-tau:].to(new.device)
    p, n = prev.numel(), new.numel()
    s = torch.cat([prev.double(), new.reshape(-1).double()])  # [p + n] the stream
    ok = torch.isfinite(s)  # [p + n] values that enter mu/sigma
    # Shift by the first finite value before summing: a constant stretch then sums to exactly 0, so its
    # sigma is exactly 0 and its own value never clears the threshold through rounding.
    first = ok.int().argmax()  # 0 when nothing is finite (then nothing is counted either)
    shift = torch.where(ok[first], s[first], 0.0)
    x = torch.where(ok, s - shift, torch.zeros_like(s))  # [p + n]
    zero = s.new_zeros(1)
    c0 = torch.cat([zero, ok.double().cumsum(0)])  # [p + n + 1] prefix counts
    c1 = torch.cat([zero, x.cumsum(0)])  # [p + n + 1] prefix sums
    c2 = torch.cat([zero, (x * x).cumsum(0)])  # [p + n + 1] prefix sums of squares
    hi = torch.arange(p, p + n, device=s.device)  # [n] stream index of new[i] = end of its window
    lo = (hi - tau).clamp_min(0)  # [n] window start
    count = c0[hi] - c0[lo]  # [n]
    mean = (c1[hi] - c1[lo]) / count.clamp_min(1)
    var = ((c2[hi] - c2[lo]) / count.clamp_min(1) - mean * mean).clamp_min(0)  # population variance
    threshold = mean + gamma * var.sqrt()  # [n] in shifted units
    return (count >= max(min_history, 1)) & (s[p:] - shift > threshold)  # NaN compares False


# -----------------------------------------------------------------------------
# event sizes

def fixed_boundaries(n: int, block_size: int, device: torch.device | str | None = None) -> Tensor:
    """Event starts of fixed-size blocks (InfLLM mode, ablation F): block_size, 2*block_size, ... < n."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return torch.arange(block_size, max(n, block_size), block_size, dtype=torch.long, device=device)


def enforce_event_sizes(boundaries: Tensor, n: int, min_size: int, max_size: int, last_is_open: bool = True) -> Tensor:
    """Merge events shorter than min_size forward, then cut events longer than max_size.

    1) Left to right, an event shorter than min_size absorbs the following events (its closing
       boundaries are dropped) until it reaches min_size. The last event, ending at n, is exempt when
       last_is_open (it is still growing); otherwise a too-short last event joins the previous one.
    2) An event longer than max_size is cut every max_size tokens from its start. If that leaves a
       closed tail shorter than min_size, the last cut moves back so the tail is exactly min_size: the
       piece before it is then max_size - (min_size - tail) >= min_size, which is why we require
       max_size >= 2 * min_size - 1. The open last event keeps its short tail: it is still growing.
    Events after this hold min_size..max_size tokens, except a stream shorter than min_size and the
    open last event (1..max_size). The merge is sequential over boundaries (each decision depends on
    where the current event started); the list is short (<= n / min_size), so plain Python on CPU.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    if max_size < 2 * min_size - 1:
        raise ValueError(f"max_size ({max_size}) must be >= 2 * min_size - 1 ({2 * min_size - 1}), otherwise a "
                         f"too-long event cannot always be cut into pieces of at least min_size")
    _check_boundaries(boundaries, n)
    device = boundaries.device

    # 1) merge forward: keep a boundary only if the event it closes is already long enough
    kept: list[int] = []
    start = 0
    for b in boundaries.tolist():
        if b - start >= min_size:
            kept.append(b)
            start = b
    if not last_is_open and kept and n - start < min_size:
        kept.pop()  # closed last event too short: merge it backward

    # 2) split: cuts every max_size from each event's start
    out: list[int] = []
    starts, ends = [0] + kept, kept + [n]
    for j, (s, e) in enumerate(zip(starts, ends)):
        if j > 0:
            out.append(s)
        cuts = list(range(s + max_size, e, max_size))
        open_tail = last_is_open and j == len(starts) - 1
        if cuts and e - cuts[-1] < min_size and not open_tail:
            cuts[-1] = e - min_size
        out.extend(cuts)
    return torch.tensor(out, dtype=torch.long, device=device)


# -----------------------------------------------------------------------------
# similarity graph and metrics (Eq. 2-4)

def key_similarity(keys: Tensor) -> Tensor:
    """float32 [n, n] adjacency: mean over leading dims of centred keys @ centred keys^T, negatives clamped to 0.

    Keys are centred on their mean over the n tokens (per layer and head) first. Raw keys share a large
    common component, so their plain dot products are nearly uniform and modularity would follow noise;
    measured on SmolLM2, refinement on raw keys cut a pass key's digits across events and lost it, while
    centred keys kept it in one event. The similarity is still the paper's dot product, of deviations.

    keys [..., n, d], e.g. [layers, kv_heads, n, head_dim]. The mean of B Gram matrices K_b K_b^T is
    one Gram matrix of the keys laid side by side, [n, B*d] @ [B*d, n] / B: one GEMM, no [B, n, n]
    intermediate. Negative similarities are clamped because modularity and conductance need
    non-negative edge weights (see the module docstring).
    """
    if keys.dim() < 2:
        raise ValueError(f"expected keys [..., n, d], got {tuple(keys.shape)}")
    n, d = keys.shape[-2:]
    k = keys.float().reshape(-1, n, d)  # [B, n, d]
    k = k - k.mean(dim=1, keepdim=True)  # [B, n, d] deviations from each layer/head's mean key
    b = k.shape[0]
    k = k.transpose(0, 1).reshape(n, b * d)  # [n, B*d]
    return (k @ k.T).div_(b).clamp_min_(0)


def _labels(boundaries: Tensor, n: int, device) -> Tensor:
    """long [n]: community index of every node for the contiguous partition given by boundaries."""
    marks = torch.zeros(n, dtype=torch.long, device=device)
    marks[boundaries.to(device)] = 1
    return marks.cumsum(0)


def modularity(adjacency: Tensor, boundaries: Tensor) -> float:
    """Newman modularity of the contiguous partition, Q = 1/(2m) sum_ij [A_ij - k_i k_j / 2m] delta(c_i, c_j).

    2m = sum_ij A_ij, k_i = row sums, k_j = column sums (the same for a symmetric graph; the paper's
    Eq. 3 has 1/(4m), a constant factor that changes no argmax). The literal O(n^2) formula in float64:
    a reference for tests and the segmentation benchmark, not the refinement's inner loop.
    A graph with no edge weight has no structure to measure: Q = 0.
    """
    a = adjacency.double()  # [n, n]
    n = a.shape[0]
    _check_boundaries(boundaries, n)
    two_m = a.sum()
    if two_m <= 0:
        return 0.0
    c = _labels(boundaries, n, a.device)  # [n]
    same = c[:, None] == c[None, :]  # [n, n] delta(c_i, c_j)
    expected = torch.outer(a.sum(1), a.sum(0)) / two_m  # [n, n] k_i k_j / 2m
    return float(((a - expected) * same).sum() / two_m)


def conductance(adjacency: Tensor, boundaries: Tensor) -> float:
    """Paper Eq. 4: min over communities S of cut(S, V\\S) / min(vol(S), vol(V\\S)), vol = internal weight.

    vol(S) = sum_{i,j in S} A_ij as the paper defines it (not the usual sum of degrees). A community
    whose denominator is 0 (e.g. the only community) scores inf. Lower is better. A direct reference from
    the community block sums (`community_blocks`), not the refinement's path.
    """
    _check_boundaries(boundaries, adjacency.shape[0])
    return float(_conductance_of_blocks(community_blocks(adjacency.double(), boundaries)))


def community_blocks(adjacency: Tensor, boundaries: Tensor) -> Tensor:
    """E [..., C, C] with E[p, q] = sum_{i in p, j in q} A_ij for the contiguous partition, from
    M^T A M with M the one-hot membership [n, C]. adjacency [..., n, n]; the dtype is the adjacency's.
    Volumes and cuts are then sums of non-negative blocks (no inclusion-exclusion), so an empty one is 0."""
    n = adjacency.shape[-1]
    m = torch.nn.functional.one_hot(_labels(boundaries, n, adjacency.device)).to(adjacency.dtype)  # [n, C]
    return m.T @ adjacency @ m


def _conductance_of_blocks(e: Tensor) -> Tensor:
    """[...] Eq. 4 from block sums e [..., C, C]."""
    other = 1.0 - torch.eye(e.shape[-1], dtype=e.dtype, device=e.device)  # [C, C] 1 where p != S
    vol_in = e.diagonal(dim1=-2, dim2=-1)  # [..., C] vol(S)
    vol_out = torch.einsum("sp,...pq,sq->...s", other, e, other)  # [..., C] vol(V \ S)
    cut = (e * other).sum(-1)  # [..., C] sum_{i in S, j not in S} A_ij
    denom = torch.minimum(vol_in, vol_out)
    return torch.where(denom > 0, cut / denom, torch.inf).amin(-1)


def partition_scores(adjacency: Tensor, boundaries: Tensor) -> dict[str, Tensor]:
    """Modularity (Eq. 3), conductance (Eq. 4) and intra/inter similarity (Eq. 5) of one partition on many graphs.

    adjacency [..., n, n] non-negative (e.g. one graph per layer and head, as the paper's Table 2 scores them);
    returns float64 tensors [...]. Intra/inter is the mean over communities of intra(S) / inter(S), communities
    with no outside weight left out (the ratio is undefined there); NaN when no community has any.
    All three come from one set of block sums, so scoring a segmentation costs one M^T A M.
    """
    a = adjacency.double()
    _check_boundaries(boundaries, a.shape[-1])
    e = community_blocks(a, boundaries)  # [..., C, C]
    two_m = e.sum(dim=(-2, -1))  # [...]
    degree_out, degree_in = e.sum(-1), e.sum(-2)  # [..., C] summed degrees of each community
    intra = e.diagonal(dim1=-2, dim2=-1)  # [..., C]
    safe = torch.where(two_m > 0, two_m, 1.0)
    q = (intra.sum(-1) - (degree_out * degree_in).sum(-1) / safe) / safe
    inter = degree_out - intra
    ratios = torch.where(inter > 0, intra / torch.where(inter > 0, inter, 1.0), torch.nan)
    return {"modularity": torch.where(two_m > 0, q, 0.0), "conductance": _conductance_of_blocks(e),
            "intra_inter": ratios.nanmean(-1)}


# -----------------------------------------------------------------------------
# refinement (Alg. 1)

def refine_boundaries(adjacency: Tensor, boundaries: Tensor, metric: Literal["modularity", "conductance"]) -> Tensor:
    """Algorithm 1: move each boundary to the best split of the span between its neighbours.

    With B = [0] + boundaries + [n], for i = 0..k-1 in order: alpha = B[i] (already refined),
    gamma = B[i+2] (still original), and B[i+1] becomes the beta_hat in (alpha, gamma) that maximises
    the modularity (or minimises the conductance, Eq. 4) of the subgraph on [alpha, gamma) split into
    [alpha, beta_hat) and [beta_hat, gamma). Degrees, volumes and cuts are those of the subgraph.
    Ties (within a relative 1e-9) keep the candidate closest to the original boundary, then the
    smaller one. Block sums below 1e-12 of the total weight count as 0: the integral image leaves
    rounding noise (~1e-16 of the total) where a block is empty, and noise must not make an empty part
    look non-empty (it would turn an inf conductance finite). The result stays strictly increasing:
    beta_hat lies strictly between its neighbours.

    adjacency [n, n] non-negative (see key_similarity), boundaries long [k] sorted in (0, n).
    Returns long [k] on the boundaries' device.
    """
    if metric not in ("modularity", "conductance"):
        raise ValueError(f"metric must be 'modularity' or 'conductance', got {metric!r}")
    if adjacency.dim() != 2 or adjacency.shape[0] != adjacency.shape[1]:
        raise ValueError(f"expected a square adjacency [n, n], got {tuple(adjacency.shape)}")
    n = adjacency.shape[0]
    _check_boundaries(boundaries, n)
    if boundaries.numel() == 0:
        return boundaries.to(torch.long).clone()

    # Integral image, P[r, c] = sum(A[:r, :c]): any block sum is 4 lookups. It lives on the host: the
    # sequential loop below does ~25 small vector ops per boundary, and numpy runs those in ~1 us each
    # where torch dispatch costs 5-10 us on CPU (plus a launch and a sync per boundary on a GPU).
    # One allocation, filled in place: fresh [n, n] float64 temporaries cost more in page faults than
    # the sums themselves.
    P_t = torch.empty(n + 1, n + 1, dtype=torch.float64)  # [n+1, n+1]
    P_t[0].zero_()
    P_t[1:, 0].zero_()
    P_t[1:, 1:].copy_(adjacency.detach())  # to host and float64 in one copy
    P_t[1:, 1:].cumsum_(0).cumsum_(1)
    P = P_t.numpy()
    snap = _SNAP_RTOL * abs(P[n, n])  # block sums below this are rounding noise of P's magnitude

    def block(r0, r1, c0, c1) -> np.ndarray:
        """sum(A[r0:r1, c0:c1]) with row/col limits broadcast over candidates, noise snapped to 0."""
        s = P[r1, c1] - P[r0, c1] - P[r1, c0] + P[r0, c0]
        s[np.abs(s) <= snap] = 0.0
        return s

    b = [0] + boundaries.tolist() + [n]
    for i in range(len(b) - 2):
        alpha, beta, gamma = b[i], b[i + 1], b[i + 2]
        if gamma - alpha < 2:
            continue
        c = np.arange(alpha + 1, gamma)  # [m] candidate starts of the second part
        e1 = block(alpha, c, alpha, c)  # [m] weight inside [alpha, c)
        e2 = block(c, gamma, c, gamma)  # [m] weight inside [c, gamma)
        cut12 = block(alpha, c, c, gamma)  # [m] rows in part 1, cols in part 2
        cut21 = block(c, gamma, alpha, c)  # [m] rows in part 2, cols in part 1
        if metric == "modularity":
            w = e1 + e2 + cut12 + cut21  # [m] 2m of the subgraph (the same value for every c)
            ws = np.where(w > 0, w, 1.0)  # safe divisor; w = 0 (no edges) scores 0 below
            # degrees within the subgraph: out(S1) = e1 + cut12, in(S1) = e1 + cut21, and so on
            expected = (e1 + cut12) * (e1 + cut21) + (e2 + cut21) * (e2 + cut12)
            score = np.where(w > 0, (e1 + e2) / ws - expected / (ws * ws), 0.0)
        else:
            denom = np.minimum(e1, e2)  # Eq. 4: min(vol(S), vol(V\S)), the same for both S
            cond = np.minimum(cut12, cut21) / np.where(denom > 0, denom, 1.0)
            score = -np.where(denom > 0, cond, np.inf)  # maximise -conductance
        best = score.max()
        near = score >= best - _TIE_RTOL * max(abs(best), 1.0)  # [m] ties with the best
        # among ties: closest to the original beta, then the smaller position
        rank = np.where(near, 2 * np.abs(c - beta) + (c > beta), 2 * n + 2)
        b[i + 1] = int(c[rank.argmin()])
    return torch.tensor(b[1:-1], dtype=torch.long, device=boundaries.device)


def _check_boundaries(boundaries: Tensor, n: int) -> None:
    """Boundaries must be a 1-D integer tensor, strictly increasing, inside (0, n)."""
    if boundaries.dim() != 1 or boundaries.dtype.is_floating_point or boundaries.dtype == torch.bool:
        raise ValueError(f"boundaries must be a 1-D integer tensor, got {boundaries.dtype} {tuple(boundaries.shape)}")
    if boundaries.numel() == 0:
        return
    if bool(boundaries[0] <= 0) or bool(boundaries[-1] >= n) or bool((boundaries.diff() <= 0).any()):
        raise ValueError(f"boundaries must be strictly increasing event starts in (0, {n}), got {boundaries.tolist()}")
