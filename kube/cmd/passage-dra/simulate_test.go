//go:build !passagesim

package main

import "testing"

// TestNoSimulationInProductionBuilds: only a passagesim build (the cluster tests') has
// simulated hardware beneath the turnaround.
func TestNoSimulationInProductionBuilds(t *testing.T) {
	if simulate != nil {
		t.Fatal("a build without -tags passagesim sets the simulate hook")
	}
}
