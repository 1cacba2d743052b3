//go:build tools

// Package runc only names the command ../build.sh builds, so go mod tidy pins everything
// it imports.
package runc

import _ "github.com/opencontainers/runc"
