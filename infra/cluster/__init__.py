"""The two-node cluster on one machine (netns.sh) and its Python handle (control.py)."""
