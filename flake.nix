{
  # `nix develop`: Python 3.11 with the C++ runtime that the PyTorch wheels link against, and the
  # project in a virtualenv (.venv) created on first entry. Inside it, `snakemake` and `pytest` run
  # as in README.md. Python packages come from PyPI through pip, as on a plain machine, so that the
  # shell and CI install exactly the same versions.
  description = "VCPO reproduction development shell";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          packages = [ pkgs.python311 pkgs.git pkgs.gcc ];
          shellHook = ''
            export LD_LIBRARY_PATH=${pkgs.lib.makeLibraryPath [ pkgs.stdenv.cc.cc.lib pkgs.zlib ]}''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            if [ ! -x .venv/bin/python ]; then
              python3 -m venv .venv
              .venv/bin/pip install torch==2.13.0
              .venv/bin/pip install -e ".[test]"
            fi
            source .venv/bin/activate
          '';
        };
      });
    };
}
