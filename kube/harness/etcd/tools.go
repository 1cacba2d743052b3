//go:build tools

// Package etcd only names the etcd server so go mod tidy pins what it imports;
// build.sh builds it.
package etcd

import _ "go.etcd.io/etcd/server/v3"
