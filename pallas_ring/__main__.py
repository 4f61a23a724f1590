from pallas_ring.cli import main

if __name__ == "__main__":
  main()
