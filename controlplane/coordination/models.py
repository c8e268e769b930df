"""ORM for the database side of coordination: one epoch counter per notification topic."""

from __future__ import annotations

from sqlalchemy import BigInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base


class Epoch(Base):
    """A counter bumped in the transaction that changes what `topic` announces (e.g. a token
    revocation); API processes without Redis poll it and act when it moved."""

    __tablename__ = "coordination_epochs"

    topic: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
