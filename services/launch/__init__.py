"""Starting, supervising and finding whole stacks: local processes (`lamina up`) and Ray actors."""
