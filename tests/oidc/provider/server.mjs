// A real OpenID Connect provider (the npm package oidc-provider) for the single sign-on tests.
//
// One static confidential client; PKCE required. There is no login form: the interaction signs in the
// account named by the control file (a JSON file the test rewrites between sign-ins) and grants what the
// client asked. The same file gives each account's claims, read at every token and userinfo request, so a
// test changes a user's groups and the next sign-in sees it. "idTokenExpired": true makes the next ID tokens
// expired when issued, to test the platform's expiry check against a real provider.
//
// Environment: PORT, ISSUER, CLIENT_ID, CLIENT_SECRET, REDIRECT_URI, CONTROL_FILE.
import { generateKeyPairSync } from 'node:crypto';
import { readFileSync } from 'node:fs';

import Provider from 'oidc-provider';

const env = process.env;
const control = () => JSON.parse(readFileSync(env.CONTROL_FILE, 'utf8'));

const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
const signingKey = { ...privateKey.export({ format: 'jwk' }), kid: 'test-key', use: 'sig', alg: 'RS256' };

const provider = new Provider(env.ISSUER, {
  clients: [{
    client_id: env.CLIENT_ID,
    client_secret: env.CLIENT_SECRET,
    redirect_uris: [env.REDIRECT_URI],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_post',
  }],
  jwks: { keys: [signingKey] },
  pkce: { required: () => true },
  scopes: ['openid', 'email', 'profile', 'groups'],
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['preferred_username', 'given_name', 'family_name'],
    groups: ['groups'],
  },
  async findAccount(ctx, id) {
    return { accountId: id, claims: async () => ({ sub: id, ...(control().accounts[id] || {}) }) };
  },
  features: { devInteractions: { enabled: false } },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  cookies: { keys: ['test-only-cookie-key'] },
  ttl: { AccessToken: 600, AuthorizationCode: 60, IdToken: 600, Interaction: 600, Session: 3600, Grant: 3600 },
});

// The expired-token switch: ID tokens issued an hour ago (exp in the past), signed like any other.
const issue = provider.IdToken.prototype.issue;
provider.IdToken.prototype.issue = function issueMaybeExpired(options = {}) {
  if (options.use === 'idtoken' && control().idTokenExpired) {
    return issue.call(this, { ...options, expiresAt: Math.floor(Date.now() / 1000) - 3600 });
  }
  return issue.call(this, options);
};

// The interaction: sign in the control file's account, grant the requested scopes and claims.
provider.use(async (ctx, next) => {
  const match = ctx.path.match(/^\/interaction\/([^/]+)$/);
  if (!match) return next();
  const details = await provider.interactionDetails(ctx.req, ctx.res);
  let result;
  if (details.prompt.name === 'login') {
    result = { login: { accountId: control().login } };
  } else {
    const grant = details.grantId
      ? await provider.Grant.find(details.grantId)
      : new provider.Grant({ accountId: details.session.accountId, clientId: details.params.client_id });
    const missing = details.prompt.details;
    if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
    if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
    result = { consent: { grantId: await grant.save() } };
  }
  ctx.redirect(await provider.interactionResult(ctx.req, ctx.res, result, { mergeWithLastSubmission: false }));
});

provider.listen(Number(env.PORT), '127.0.0.1', () => {
  console.log(`oidc-provider listening on ${env.ISSUER}`);
});
