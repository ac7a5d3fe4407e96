"""The request record (``router.record.format`` owns its shape)."""
