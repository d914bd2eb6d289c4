"""CSC's bytes on the wire per step against its density, on ``syncline train``'s default GPT."""
