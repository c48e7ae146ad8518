package daemon

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/envsnap/envsnap/internal/peer"
)

// peerTier is the daemon's end of the peer tier: the client every layer
// fetches through and the counters status reports.
type peerTier struct {
	client  *peer.Client
	metrics *peer.Metrics
	auth    peer.Auth
}

// startPeerClient builds the peer client of cfg (nil when peers are off):
// its member source is watched until ctx ends.
func (d *daemon) startPeerClient(ctx context.Context, cfg PeerConfig, reg prometheus.Registerer) (*peer.Client, error) {
	if !cfg.Enabled {
		return nil, nil
	}
	var auth peer.Auth
	if cfg.TokenFile != "" {
		tok, err := peer.NewToken(cfg.TokenFile)
		if err != nil {
			return nil, err
		}
		auth.Token = tok
	}
	if cfg.TLSCert != "" {
		auth.TLS = &peer.TLSFiles{Cert: cfg.TLSCert, Key: cfg.TLSKey, CA: cfg.TLSCA, ServerName: cfg.TLSServerName}
	}
	port, err := peer.Port(cfg.Listen)
	if err != nil {
		return nil, err
	}
	var members peer.Members
	switch {
	case len(cfg.Members) > 0:
		members = peer.Static(cfg.Members)
	case cfg.DNS != "":
		resolver := net.DefaultResolver
		if cfg.DNSServer != "" {
			resolver = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, network, cfg.DNSServer)
			}}
		}
		w, err := peer.Watch(ctx, time.Duration(cfg.Refresh), "dns "+cfg.DNS, func(ctx context.Context) ([]string, error) {
			return peer.LookupDNS(ctx, resolver, cfg.DNS, port)
		})
		if err != nil {
			// The Service may list this pod only once it is ready.
			log.G(ctx).WithError(err).Warn("no peers yet; fetching from the registry until the next lookup")
		}
		members = w
	default:
		w, err := peer.Watch(ctx, time.Duration(cfg.Refresh), "file "+cfg.MembersFile, func(context.Context) ([]string, error) {
			return peer.ReadMembersFile(cfg.MembersFile)
		})
		if err != nil {
			log.G(ctx).WithError(err).Warn("no peers yet; fetching from the registry until the next read")
		}
		members = w
	}
	m := peer.NewMetrics()
	client, err := peer.NewClient(members, auth, peer.Options{
		Self:       cfg.Advertise,
		Port:       port,
		HedgeAfter: time.Duration(cfg.HedgeAfter),
		Timeout:    time.Duration(cfg.Timeout),
		BadFor:     time.Duration(cfg.BadFor),
	}, m)
	if err != nil {
		return nil, fmt.Errorf("peer client: %w", err)
	}
	m.CountBad(client)
	if err := reg.Register(m); err != nil {
		return nil, fmt.Errorf("register peer metrics: %w", err)
	}
	d.peers = &peerTier{client: client, metrics: m, auth: auth}
	return client, nil
}

// servePeers serves src to the other members on cfg.Listen until ctx ends.
func (d *daemon) servePeers(ctx context.Context, cfg PeerConfig, src peer.Source, errc chan<- error) error {
	srv, err := peer.NewServer(src, d.peers.auth, d.peers.metrics, peer.WithMaxServing(cfg.MaxServing))
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen for peers: %w", err)
	}
	go func() {
		if err := srv.Serve(ctx, l); err != nil {
			errc <- err
		}
	}()
	log.G(ctx).WithField("listen", cfg.Listen).Info("serving peers")
	return nil
}
