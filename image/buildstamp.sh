#!/usr/bin/env bash
# buildstamp.sh: the -ldflags that stamp passage's build (package buildinfo) from git, for
# the builds whose toolchain records none: u-root's busybox (passage is copied into its
# own module, and nothing of passage's is in the binary's build information) and a go
# build under -buildvcs=false. The revision and the modified flag are what go build
# records as vcs.revision and vcs.modified (anything in `git status --porcelain`); the
# version is "(devel)", what Go says of a build from a work tree. Outside a git checkout
# it prints nothing.
set -euo pipefail
flags=
if revision=$(git rev-parse HEAD 2>/dev/null); then
	modified=false
	[[ -z $(git status --porcelain 2>/dev/null) ]] || modified=true
	p=github.com/passage-boot/passage/buildinfo
	flags="-X $p.stampVersion=(devel) -X $p.stampRevision=$revision -X $p.stampModified=$modified"
fi
echo "$flags"
