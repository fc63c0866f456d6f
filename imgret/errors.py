"""Domain exceptions: raised by the core, mapped to 4xx in imgret/service/errors.py and to
CLI messages."""


class ImgretError(Exception):
    """Base class of every error imgret raises on purpose."""


class ImageDecodeError(ImgretError, ValueError):
    """The bytes are not an image we can decode (empty, truncated, corrupt, not an image)."""


class ImageTooLarge(ImageDecodeError):
    """The image has more pixels than the configured limit (decompression-bomb guard)."""


class CheckpointError(ImgretError, ValueError):
    """A checkpoint file is missing, unreadable, or not an imgret checkpoint."""


class ModelRunError(ImgretError):
    """A model version that cannot run, or whose vectors cannot be used (NaN or infinite
    values, the wrong shape): the version's fault, not the request's."""


class UnknownName(ImgretError, ValueError):
    """A registry name (backbone, loss, miner, ...) or option that does not exist."""

    def __init__(self, kind: str, name: str, valid: list[str] | tuple[str, ...]):
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; valid: {', '.join(self.valid)}")


class IndexStale(ImgretError):
    """A FAISS index whose manifest does not match the database."""


class IndexUnavailable(ImgretError):
    """The vector engine that holds the index (Milvus) cannot be reached or failed a call."""


class DatabaseError(ImgretError):
    """The database cannot be reached, or its schema cannot be brought up to date."""


class GalleryError(ImgretError, ValueError):
    """A gallery operation that the database state does not allow (no active model version,
    an unknown model version, vectors of the wrong dimension, ...)."""


class InvalidIndexFactory(ImgretError, ValueError):
    """A FAISS index factory string that is unparsable or would silently misbehave."""
