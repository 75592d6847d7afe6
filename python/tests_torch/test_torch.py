"""torch tensors in and out of kvdecode. Not in CI: PyPI's torch wheel brings about 5.5 GB of CUDA
libraries; `scripts/test-python-torch.sh` runs this in the venv `scripts/fixtures/make.sh` makes
(torch 2.15, CPU)."""

import numpy as np
import torch

import kvdecode


def test_torch_tensors_in_logits_out_without_copy():
    model = kvdecode.Model.demo()
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]], dtype=np.int64)
    n_new = [4, 2, 1]
    want = kvdecode.Engine(model, rows=3, max_len=32).append(ids, n_new)
    for dtype in (torch.int64, torch.int32, torch.int16):
        e = kvdecode.Engine(model, rows=3, max_len=32)
        got = e.append(torch.tensor(ids, dtype=dtype), torch.tensor(n_new), rows=torch.arange(3))
        assert np.array_equal(want.view(np.uint32), got.view(np.uint32)), dtype
    # a strided view of a bigger tensor
    wide = torch.zeros((3, 8), dtype=torch.int64)
    wide[:, ::2] = torch.tensor(ids)
    got = kvdecode.Engine(model, rows=3, max_len=32).append(wide[:, ::2], n_new)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
    # the logits become a torch tensor over the same memory
    t = torch.from_numpy(want)
    assert t.data_ptr() == want.ctypes.data and t.shape == (3, model.vocab)


def test_seed_loop_with_torch():
    """The seed's loop as a torch user writes it: idx (B, C) long tensors, n_new a CPU tensor,
    next ids from torch.argmax; equal to the engine's own greedy sampling."""
    model = kvdecode.Model.demo()
    e = kvdecode.Engine(model, rows=2, max_len=64)
    idx = torch.tensor([[3, 4, 5], [6, 7, 0]])
    logits = torch.from_numpy(e.append(idx, torch.tensor([3, 2])))
    out = [logits.argmax(-1)]
    for _ in range(5):
        logits = torch.from_numpy(e.append(out[-1][:, None]))
        out.append(logits.argmax(-1))
    ours = torch.stack(out, 1).tolist()

    g = kvdecode.Engine(model, rows=2, max_len=64)
    first, _ = g.append_sample([[3, 4, 5], [6, 7, 0]], [3, 2])
    ids, _ = g.decode_steps([0, 1], first, 5)
    assert ours == [[f] + row for f, row in zip(first, ids.tolist())]
