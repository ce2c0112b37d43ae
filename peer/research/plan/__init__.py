"""`peer plan`: compute utilisation per outer step (`command`, `round`), memory per device
(`memory`) and the planner's figures (`figures`)."""
