from kvcompass.cli import main

# Guarded: `kvcompass simulate --jobs N` starts worker processes with the "spawn" method, which
# imports this module again in each of them under another name.
if __name__ == "__main__":
    raise SystemExit(main())
