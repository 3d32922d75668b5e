"""The user's side of patchkit: Component and make (`component`), capture() (`capture`), Pipeline (`pipeline`).

Kept free of imports so that `patchkit.client.component` loads without the rest of patchkit.
"""
