"""IJB template pooling: several media (images, video frames) of a subject fused into one feature."""

from __future__ import annotations

import torch

from marginkit._validation import accepts_arrays
from marginkit.knn._search import check_embeddings, check_labels, prepare


@accepts_arrays(emb="float", template_ids="int", media_ids="int")
def template_features(
    emb: torch.Tensor, template_ids: torch.Tensor, media_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One L2-normalised feature per template: the IJB pooling.

    Each row is L2-normalised; rows of one medium (same template and media id) are averaged;
    the media means of a template are averaged with equal weight (a 300-frame video counts as
    much as one still image); the result is L2-normalised (Whitelam et al., "IARPA Janus
    Benchmark-B face dataset", CVPR-W 2017; the pooling of insightface's IJB evaluation):

    .. math::
        f_T = \frac{\sum_{m \in T} \bar x_m}{\lVert \sum_{m \in T} \bar x_m \rVert},\qquad
        \bar x_m = \frac{1}{|m|} \sum_{i \in m} \frac{x_i}{\lVert x_i \rVert}.

    Args:
        emb: ``[N, D]`` features (no all-zero row).
        template_ids: ``[N]`` integer template of each row.
        media_ids: ``[N]`` integer medium of each row (a medium shared by two templates is
            pooled separately in each); ``None``: every row is its own medium.

    Returns:
        ``(ids, features)``: the distinct template ids ascending (``[T]``) and ``[T, D]``
        features in float32 (float64 for float64 input), row ``i`` belonging to ``ids[i]``.

    Example:
        >>> import torch
        >>> e = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
        >>> ids, f = template_features(e, torch.tensor([5, 5, 5, 9]), torch.tensor([0, 0, 1, 2]))
        >>> ids.tolist(), [[round(v, 4) for v in row] for row in f.tolist()]
        ([5, 9], [[0.7071, 0.7071], [0.6, 0.8]])
    """
    check_embeddings(emb, "emb")
    n = emb.shape[0]
    check_labels(template_ids, "template_ids", n, "emb")
    x = prepare(emb.detach(), "cosine", "emb")
    ids, template = torch.unique(template_ids.to(x.device), return_inverse=True)
    if media_ids is None:
        medium_template, medium_mean = template, x
    else:
        check_labels(media_ids, "media_ids", n, "emb")
        _, media = torch.unique(media_ids.to(x.device), return_inverse=True)
        num_media = int(media.max()) + 1
        code = template * num_media + media
        codes, medium, counts = torch.unique(code, return_inverse=True, return_counts=True)
        medium_sum = x.new_zeros(codes.numel(), x.shape[1]).index_add_(0, medium, x)
        medium_mean = medium_sum / counts[:, None].to(x.dtype)
        medium_template = codes // num_media
    pooled = x.new_zeros(ids.numel(), x.shape[1]).index_add_(0, medium_template, medium_mean)
    zero = (pooled == 0).all(dim=1).nonzero()
    if zero.numel():
        raise ValueError(
            f"template {int(ids[zero[0, 0]])}: its media features cancel out (zero sum), so it has no "
            "direction; check template_ids / media_ids"
        )
    return ids, prepare(pooled, "cosine", "templates", pooled.dtype)
