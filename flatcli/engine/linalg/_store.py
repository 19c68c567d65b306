r"""Where the orthonormal bases of the Krylov methods live: all on the device, or in host memory
with at most ``capacity`` rows on the device at once (``runtime.max_device_vectors``).

Lanczos with full reorthogonalization, SLQ and Hutch++ keep bases of P-vectors: 30 Lanczos steps
of a 7B-parameter model are 840 GB in float32, far more than a GPU holds. A `BasisStore` with a
``capacity`` keeps every basis row in host memory (pinned on CUDA, so copies to the device are
asynchronous-capable DMA) and does the three operations the estimators need by streaming the
rows to the device in chunks of at most ``capacity`` rows:

* `BasisStore.project_out`: classical Gram-Schmidt ``W − Qᵀ(Q W)`` (coefficients ``C = Q W`` of
  every chunk first, then the subtraction chunk by chunk), the building block of "twice is enough";
* `BasisStore.rows`: a slice of rows (Lanczos' current block, the input of the next product);
* `BasisStore.combine`: ``Sᵀ Q`` (Ritz vectors from coefficients in the basis).

This is *host offload*, chosen over selective or partial reorthogonalization (Parlett & Scott 1979;
Simon 1984) because it changes no arithmetic: the coefficients are the same dot products, summed
over chunks instead of in one matrix product, so results equal the all-on-device run to rounding
(tests/engine/test_linalg.py checks 1e-12 in float64) and every certificate of the estimators (residuals,
the invariant-subspace test, the certified step count) stays valid as is. Its price is traffic:
each reorthogonalization pass reads the whole basis twice over the host link (at PCIe 4's nominal
~25 GB/s, a 30-vector float32 basis of a 1B-parameter model, 2 × 120 GB per pass, takes ~10 s;
docs/benchmarks/data/basis_store.json). On CPU host and device are the same memory; the default
there keeps everything in one device buffer, and a capacity only bounds the working chunks (which
is what the tests instrument: ``peak_resident`` counts the rows present on the device at once).

With ``capacity=None`` the store is the growing device buffer the estimators always had (doubling
when full) and every operation is one matrix product, as before.
"""

from __future__ import annotations

import torch

from ...validation import validate


def default_capacity(dim: int, device, dtype, fraction: float = 0.25) -> int | None:
    """``runtime.max_device_vectors: auto``: unbounded on CPU (host memory is device memory), on CUDA
    as many P-vectors as fit in ``fraction`` of the free device memory (at least 2)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return None
    try:
        free = torch.cuda.mem_get_info(dev)[0]
    except RuntimeError:
        return None
    elt = torch.finfo(dtype).bits // 8
    return int(max(2, fraction * free // max(1, dim * elt)))


class BasisStore:
    """Rows of a basis (each a P-vector), on the device or offloaded to host (module docstring).

    Parameters
    ----------
    dim : P.
    device, dtype : where and in which type the rows are used.
    capacity : most rows on the device at once; None keeps every row on the device.
    max_rows : most rows ever stored (sizes the device buffer of the unbounded store).
    preallocate : allocate the device buffer for ``max_rows`` at the first row (a thick-restart cap:
        the buffer is that size anyway, and growing it by doubling would hold the old and the new
        buffer at once, up to 1.5 × the cap's memory for a moment).
    """

    def __init__(
        self,
        dim: int,
        device,
        dtype,
        capacity: int | None = None,
        max_rows: int | None = None,
        preallocate: bool = False,
    ):
        capacity = validate("max_device_vectors", capacity, error=ValueError)
        if capacity == "auto":  # resolved by `device_capacity` before a store is built
            raise ValueError(
                "max_device_vectors must be resolved (an int ≥ 1 or null) before a store is built"
            )
        self.dim, self.dtype = int(dim), dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_rows = max_rows
        self.preallocate = bool(preallocate and max_rows)
        self.capacity = (
            None
            if capacity is None or (max_rows is not None and capacity >= max_rows)
            else int(capacity)
        )
        self._n = 0
        self._buf: torch.Tensor | None = None  # device buffer (unbounded store)
        self._host: list[torch.Tensor] = []  # host rows (offloaded store)
        self.peak_resident = 0  # most basis rows on the device at once (instrumentation)
        self.transfers = 0  # rows copied host → device

    @property
    def offloaded(self) -> bool:
        """Whether rows live in host memory (a capacity was given)."""
        return self.capacity is not None

    def __len__(self) -> int:
        return self._n

    def _resident(self, rows: int) -> None:
        self.peak_resident = max(self.peak_resident, rows)

    # ------------------------------------------------------------ writing
    def append(self, rows: torch.Tensor) -> None:
        """Add rows (k, P) at the end."""
        rows = rows.to(self.dtype)
        k = rows.shape[0]
        if self.offloaded:
            pin = self.device.type == "cuda"
            for r in rows:
                h = torch.empty(self.dim, dtype=self.dtype, pin_memory=pin)
                h.copy_(r)
                self._host.append(h)
        else:
            need = self._n + k
            if self._buf is None or need > self._buf.shape[0]:
                size = max(need, 2 * (0 if self._buf is None else self._buf.shape[0]), 32)
                size = self.max_rows if self.preallocate else size
                size = min(size, self.max_rows) if self.max_rows is not None else size
                grown = torch.empty(max(size, need), self.dim, device=self.device, dtype=self.dtype)
                if self._n:
                    grown[: self._n] = self._buf[: self._n]
                self._buf = grown
            self._buf[self._n : need] = rows
            self._resident(need)
        self._n += k

    def restart(self, S: torch.Tensor, rows: torch.Tensor) -> None:
        """Replace the basis by ``Sᵀ Q`` (S: (n, j) coefficients of the n rows, j ≤ n) followed by
        ``rows`` (k, P): a thick restart (`flatcli.engine.linalg.lanczos`). In place, a slice of
        columns at a time, so it needs no second basis: at most n × 2²² / n elements more."""
        n, j = S.shape
        if n != self._n or j > n:
            raise ValueError(
                f"restart coefficients of shape {tuple(S.shape)} for a basis of {self._n} rows"
            )
        step = max(1, (1 << 22) // max(n, 1))
        for a in range(0, self.dim, step):
            b = min(self.dim, a + step)
            if self.offloaded:
                cols = torch.stack([h[a:b] for h in self._host[:n]]).to(self.device)
                new = (S.T.to(self.device, self.dtype) @ cols).cpu()
                for i in range(j):
                    self._host[i][a:b].copy_(new[i])
            else:
                self._buf[:j, a:b] = S.T.to(self.device, self.dtype) @ self._buf[:n, a:b]
        if self.offloaded:
            del self._host[j:]
        self._n = j
        self.append(rows)

    # ------------------------------------------------------------ reading
    def _chunks(self, start: int = 0, stop: int | None = None):
        """(offset, device tensor of rows) over [start, stop), at most ``capacity`` rows each."""
        stop = self._n if stop is None else stop
        if not self.offloaded:
            yield start, self._buf[start:stop]
            return
        for a in range(start, stop, self.capacity):
            b = min(stop, a + self.capacity)
            self._resident(b - a)
            self.transfers += b - a
            yield a, torch.stack(self._host[a:b]).to(self.device, non_blocking=True)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) on the device (an offloaded store copies them; more than ``capacity``
        rows is an error: the caller's block must fit)."""
        if not self.offloaded:
            return self._buf[start:stop]
        if stop - start > self.capacity:
            raise ValueError(
                f"{stop - start} rows asked of a store holding at most {self.capacity} on the device"
            )
        return next(self._chunks(start, stop))[1]

    def coefficients(self, W: torch.Tensor) -> torch.Tensor:
        """``Q Wᵀ``, shape (n, k), for W of shape (k, P)."""
        if self._n == 0:
            return W.new_zeros(0, W.shape[0])
        return torch.cat([Q @ W.T for _, Q in self._chunks()])

    def subtract(self, W: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """``W − Cᵀ Q`` for coefficients C of shape (n, k) (a new tensor)."""
        out = W.clone() if self.offloaded else W
        for a, Q in self._chunks():
            part = C[a : a + Q.shape[0]].T @ Q
            out = out - part if not self.offloaded else out.sub_(part)
        return out

    def project_out(self, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One classical Gram-Schmidt pass: (W − Qᵀ(QWᵀ))ᵀ-rows and the coefficients ``Q Wᵀ``."""
        C = self.coefficients(W)
        return self.subtract(W, C), C

    def combine(self, S: torch.Tensor) -> torch.Tensor:
        """``Sᵀ Q``: rows of coefficients S (n, k) into P-vectors, shape (k, P)."""
        out = None
        for a, Q in self._chunks():
            part = (Q.T @ S[a : a + Q.shape[0]].to(Q.dtype)).T
            out = part if out is None else out.add_(part)
        return out


def device_capacity(setting, dim: int, device, dtype) -> int | None:
    """The capacity an estimator uses: ``setting`` (its `EstimatorSettings.max_device_vectors`: an
    int, or None for unbounded); ``"auto"``: `default_capacity`."""
    if isinstance(setting, str) and setting == "auto":
        return default_capacity(dim, device, dtype)
    return validate("max_device_vectors", setting, error=ValueError)
