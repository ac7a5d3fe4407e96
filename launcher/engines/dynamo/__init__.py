"""``generation.engine: dynamo-vllm`` and ``dynamo-mocker``: one Dynamo worker process per engine slot
(``worker``), their spec settings and what they declare (``kind``)."""
