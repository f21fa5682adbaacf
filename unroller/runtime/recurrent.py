"""Recurrent layers that are the same on both platforms: ``lstm`` and ``gru``.

torch.nn.LSTM / torch.nn.GRU with the layer's own parameters (``weight_ih_l0``, ...,
``bias_hh_l1_reverse``), run one time step at a time with the ops both platforms have
(matmul, sigmoid, tanh, cat, stack, slicing; PopTorch has all of them), so
``unroller.runtime.gpu`` and ``unroller.runtime.ipu`` import them from here.

Layout, as every tensor of the language: the batch first. x is [N, L, E], the output
[N, L, D * H] (D = 2 when bidirectional: the forward direction's H, then the reverse one's),
the initial states h0 / c0 [N, S, H] with S = num_layers * D in torch's order (layer 0
forward, layer 0 reverse, layer 1 forward, ...): torch's h0 transposed (1, 0). An absent
initial state is zeros, as in torch.

The forward keeps, per layer and direction (stacked along dim 1, S of them) and per step in
the order the direction runs (time L - 1 first for the reverse one), the gates after their
activations (LSTM: i, f, g, o; GRU: r, z, n and the hidden part of n's pre-activation,
W_hn h + b_hn, which the reset gate multiplies) [N, S, L, 4H], and the states around the
steps [N, S, L + 1, H] (slot 0 the initial state, slot s + 1 after step s): the hidden
states, and the LSTM's cell states. The backward is unrolled through time (BPTT): per layer
from the last one down, per direction, one explicit step per time step from the last step
run back to the first, reading only those tensors, the layer input (x for layer 0; below the
last layer, the hidden states of the layer under it) and the weights. A compressor may
replace x, the gates and the states (the registry declares them activations).
"""

from __future__ import annotations

import torch
from torch import Tensor

from unroller.runtime.common import Grads, Needs, _exports, _fit, _need

#: The layers the registry always lists parameters for (``layer_params.listed``): the
#: backward returns a slot per parameter of this many layers, of more for a deeper statement.
LISTED_LAYERS = 4
#: Parameters per layer and direction, in torch's (and the registry's) order.
PER_DIRECTION = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def _split(operands: tuple) -> tuple[Tensor, list[Tensor], torch.nn.Module]:
    """(x, the initial states given, the layer): the kernel's positional arguments."""
    return operands[0], list(operands[1:-1]), operands[-1]


def _weights(layer: torch.nn.Module, index: int, reverse: int) -> list[Tensor | None]:
    """(weight_ih, weight_hh, bias_ih, bias_hh) of one layer and direction (biases None
    when bias=False), read from the parameter dict by their state-dict names."""
    suffix = "_reverse" if reverse else ""
    params = layer._parameters
    return [params.get(f"{name}_l{index}{suffix}") for name in PER_DIRECTION]


def _affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T (+ bias), as torch's cells compute each half of a gate."""
    y = torch.matmul(x, weight.t())
    return y if bias is None else y + bias


def _forward(
    x: Tensor,
    states: list[Tensor],
    layer: torch.nn.Module,
    num_layers: int,
    bidirectional: bool,
    cell,
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """(output, gates, hidden states, cell states) for either cell; ``cell`` runs one step:
    (x part of the gates at t, h, c, w_hh, b_hh) -> (h, c, gates)."""
    directions = 2 if bidirectional else 1
    hidden = layer._parameters["weight_hh_l0"].shape[1]
    batch, length = x.shape[0], x.shape[1]
    gates, hiddens, cells = [], [], []
    seq = x
    for index in range(num_layers):
        outs = []
        for reverse in range(directions):
            k = index * directions + reverse
            w_ih, w_hh, b_ih, b_hh = _weights(layer, index, reverse)
            xw = _affine(seq, w_ih, b_ih)  # [N, L, G]: every step's input part at once
            h = states[0][:, k] if states else xw.new_zeros(batch, hidden)
            c = states[1][:, k] if len(states) > 1 else xw.new_zeros(batch, hidden)
            hs, cs, gs = [h], [c], []
            for step in range(length):
                t = length - 1 - step if reverse else step
                h, c, g = cell(xw[:, t], h, c, w_hh, b_hh)
                hs.append(h)
                cs.append(c)
                gs.append(g)
            gates.append(torch.stack(gs, 1))
            hiddens.append(torch.stack(hs, 1))
            cells.append(torch.stack(cs, 1))
            outs.append(_in_time_order(hiddens[-1], reverse))
        seq = torch.cat(outs, 2) if directions == 2 else outs[0]
    return seq, torch.stack(gates, 1), hiddens, cells


def _in_time_order(states: Tensor, reverse: int) -> Tensor:
    """[N, L, H] hidden states by time from [N, L + 1, H] by step (slot 0 the initial one)."""
    if not reverse:
        return states[:, 1:]
    length = states.shape[1] - 1
    return torch.stack([states[:, length - t] for t in range(length)], 1)


def _layer_input(x: Tensor, hiddens: Tensor, index: int, directions: int) -> Tensor:
    """The input sequence of layer ``index``: x, or the layer below's output made again from
    its kept hidden states."""
    if index == 0:
        return x
    below = [_in_time_order(hiddens[:, (index - 1) * directions + r], r) for r in range(directions)]
    return torch.cat(below, 2) if directions == 2 else below[0]


def _backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    gates: Tensor,
    hiddens: Tensor,
    cells: Tensor | None,
    num_layers: int,
    bidirectional: bool,
    initial_states: int,
    needs: Needs | None,
    step_back,
) -> Grads:
    """BPTT for either cell (module doc). ``step_back`` undoes one step: (dh, dc, gates,
    h_prev, c_prev, c) -> (gradient of the input part of the gates, of the hidden part,
    the direct gradient of h_prev, of c_prev); the hidden part's gradient reaches h_prev
    again through w_hh here. Returns (gx, gh0[, gc0], then every registry parameter slot)."""
    directions = 2 if bidirectional else 1
    hidden = hiddens.shape[-1]
    length = x.shape[1]
    inputs = 1 + initial_states
    listed = max(LISTED_LAYERS, num_layers)
    slots: list[Tensor | None] = [None] * (listed * 2 * len(PER_DIRECTION))

    def slot(index: int, reverse: int, j: int) -> int:
        return inputs + (index * 2 + reverse) * len(PER_DIRECTION) + j

    def params_wanted(index: int) -> bool:
        return any(_need(needs, slot(index, r, j)) for r in range(directions) for j in range(4))

    # the layers the backward runs through: from the last down to the lowest one whose
    # gradients (or whose input's, or an initial state's) are wanted
    lowest = num_layers
    if _need(needs, 0) or any(_need(needs, 1 + i) for i in range(initial_states)):
        lowest = 0
    lowest = min([lowest] + [i for i in range(num_layers) if params_wanted(i)])
    d_init: list[list[Tensor | None]] = [[None] * (num_layers * directions) for _ in range(2)]
    d_seq = g
    for index in range(num_layers - 1, lowest - 1, -1):
        seq = _layer_input(x, hiddens, index, directions)
        d_below = None
        for reverse in range(directions):
            k = index * directions + reverse
            w_ih, w_hh, b_ih, b_hh = _weights(layer, index, reverse)
            d_out = d_seq[..., reverse * hidden : (reverse + 1) * hidden]
            dh = d_out.new_zeros(d_out.shape[0], hidden)
            dc = dh
            d_in, d_hid = [], []  # per step, last step run first
            for step in range(length - 1, -1, -1):
                t = length - 1 - step if reverse else step
                dh = dh + d_out[:, t]
                c_prev = cells[:, k, step] if cells is not None else None
                c = cells[:, k, step + 1] if cells is not None else None
                h_prev = hiddens[:, k, step]
                dgi, dgh, dh, dc = step_back(dh, dc, gates[:, k, step], h_prev, c_prev, c)
                dh = dh + torch.matmul(dgh, w_hh)
                d_in.append(dgi)
                d_hid.append(dgh)
            d_init[0][k], d_init[1][k] = dh, dc
            # by time for the input weights; by step (as hiddens) for the hidden ones
            dgi_t = torch.stack(d_in if reverse else d_in[::-1], 1)  # [N, L, G]
            dgh_s = torch.stack(d_hid[::-1], 1)
            features = gates.shape[-1] // 4 * (3 if cells is None else 4)
            if _need(needs, slot(index, reverse, 0)):
                flat = dgi_t.reshape(-1, features).t()
                slots[slot(index, reverse, 0) - inputs] = torch.matmul(
                    flat, seq.reshape(-1, seq.shape[-1])
                )
            if _need(needs, slot(index, reverse, 1)):
                prev = hiddens[:, k, :length].reshape(-1, hidden)
                slots[slot(index, reverse, 1) - inputs] = torch.matmul(
                    dgh_s.reshape(-1, features).t(), prev
                )
            if b_ih is not None and _need(needs, slot(index, reverse, 2)):
                slots[slot(index, reverse, 2) - inputs] = dgi_t.sum((0, 1))
            if b_hh is not None and _need(needs, slot(index, reverse, 3)):
                slots[slot(index, reverse, 3) - inputs] = dgh_s.sum((0, 1))
            if index > lowest or (index == 0 and _need(needs, 0)):
                part = torch.matmul(dgi_t, w_ih)
                d_below = part if d_below is None else d_below + part
        d_seq = d_below
    gx = d_seq if _need(needs, 0) else None
    firsts = []
    for i in range(initial_states):
        given = d_init[i]
        firsts.append(torch.stack(given, 1) if all(t is not None for t in given) else None)
    return _fit((gx, *firsts, *slots), needs)


# ---------------------------------------------------------------- LSTM


def _lstm_cell(
    xw: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, b_hh: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One step of torch.nn.LSTM's cell: gates i, f, g, o; c = f c + i g; h = o tanh(c)."""
    z = xw + _affine(h, w_hh, b_hh)
    size = h.shape[-1]
    i = torch.sigmoid(z[:, :size])
    f = torch.sigmoid(z[:, size : 2 * size])
    g = torch.tanh(z[:, 2 * size : 3 * size])
    o = torch.sigmoid(z[:, 3 * size :])
    c = f * c + i * g
    h = o * torch.tanh(c)
    return h, c, torch.cat((i, f, g, o), 1)


def _lstm_step_back(
    dh: Tensor, dc: Tensor, gates: Tensor, h_prev: Tensor, c_prev: Tensor, c: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One LSTM step backward: the gates' pre-activation gradient (one for both affine
    parts), no direct path from h to h_prev, and c_prev's gradient f dc."""
    size = dh.shape[-1]
    i, f = gates[:, :size], gates[:, size : 2 * size]
    g, o = gates[:, 2 * size : 3 * size], gates[:, 3 * size :]
    tc = torch.tanh(c)
    dc = dc + dh * o * (1 - tc * tc)
    dz = torch.cat(
        (
            dc * g * i * (1 - i),
            dc * c_prev * f * (1 - f),
            dc * i * (1 - g * g),
            dh * tc * o * (1 - o),
        ),
        1,
    )
    return dz, dz, dh.new_zeros(dh.shape), dc * f


def lstm(
    *operands: Tensor | torch.nn.Module, num_layers: int = 1, bidirectional: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """torch.nn.LSTM (batch first) on (x[, h0[, c0]], layer): (output [N, L, D H], gates
    [N, S, L, 4H], hidden states and cell states [N, S, L + 1, H]; module doc)."""
    x, states, layer = _split(operands)
    out, gates, hiddens, cells = _forward(x, states, layer, num_layers, bidirectional, _lstm_cell)
    return out, gates, torch.stack(hiddens, 1), torch.stack(cells, 1)


def lstm_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    gates: Tensor,
    hiddens: Tensor,
    cells: Tensor,
    *,
    num_layers: int = 1,
    bidirectional: bool = False,
    initial_states: int,
    needs: Needs | None = None,
) -> Grads:
    """(gx[, gh0[, gc0]], then every parameter slot of the registry), unrolled through
    time; ``initial_states`` is how many of h0, c0 the forward was given."""
    return _backward(
        g,
        x,
        layer,
        gates,
        hiddens,
        cells,
        num_layers,
        bidirectional,
        initial_states,
        needs,
        _lstm_step_back,
    )


# ---------------------------------------------------------------- GRU


def _gru_cell(
    xw: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, b_hh: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One step of torch.nn.GRU's cell: r, z from both parts, n = tanh(x part + r (W_hn h +
    b_hn)), h = (1 - z) n + z h; kept: r, z, n and W_hn h + b_hn."""
    hw = _affine(h, w_hh, b_hh)
    size = h.shape[-1]
    r = torch.sigmoid(xw[:, :size] + hw[:, :size])
    z = torch.sigmoid(xw[:, size : 2 * size] + hw[:, size : 2 * size])
    hn = hw[:, 2 * size :]
    n = torch.tanh(xw[:, 2 * size :] + r * hn)
    h = (1 - z) * n + z * h
    return h, c, torch.cat((r, z, n, hn), 1)


def _gru_step_back(
    dh: Tensor, dc: Tensor, gates: Tensor, h_prev: Tensor, c_prev: Tensor, c: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One GRU step backward: the input part's gradient (r, z, n), the hidden part's (r, z,
    and r times n's), and h_prev's direct gradient z dh."""
    size = dh.shape[-1]
    r, z = gates[:, :size], gates[:, size : 2 * size]
    n, hn = gates[:, 2 * size : 3 * size], gates[:, 3 * size :]
    dn = dh * (1 - z) * (1 - n * n)
    dr = dn * hn * r * (1 - r)
    dz = dh * (h_prev - n) * z * (1 - z)
    return torch.cat((dr, dz, dn), 1), torch.cat((dr, dz, dn * r), 1), dh * z, dc


def gru(
    *operands: Tensor | torch.nn.Module, num_layers: int = 1, bidirectional: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """torch.nn.GRU (batch first) on (x[, h0], layer): (output [N, L, D H], gates [N, S, L,
    4H] (r, z, n, W_hn h + b_hn), hidden states [N, S, L + 1, H]; module doc)."""
    x, states, layer = _split(operands)
    out, gates, hiddens, _ = _forward(x, states, layer, num_layers, bidirectional, _gru_cell)
    return out, gates, torch.stack(hiddens, 1)


def gru_backward(
    g: Tensor,
    x: Tensor,
    layer: torch.nn.Module,
    gates: Tensor,
    hiddens: Tensor,
    *,
    num_layers: int = 1,
    bidirectional: bool = False,
    initial_states: int,
    needs: Needs | None = None,
) -> Grads:
    """(gx[, gh0], then every parameter slot of the registry), unrolled through time."""
    return _backward(
        g,
        x,
        layer,
        gates,
        hiddens,
        None,
        num_layers,
        bidirectional,
        initial_states,
        needs,
        _gru_step_back,
    )


#: The kernels both platforms take from here (through ``unroller.runtime.shared``).
__all__ = _exports(globals())
